"""The fixture of the server tests: the app `pagedllm serve` builds, without listening."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints import cli, engine_args, serve_setup
from pagedllm.entrypoints.cli import main
from tests.conftest import assert_pool_free


@pytest.fixture
def serve(monkeypatch, tiny_llama):
    """serve(*flags) -> (app, uvicorn options, the LLMs made so far) of `pagedllm serve TINY_MODEL *flags`
    without listening (64 blocks unless the flags say otherwise); every engine built is checked for a
    free pool at the end."""
    made = []
    real_make_llm = engine_args.make_llm

    def recording_make_llm(args, **overrides):
        made.append(real_make_llm(args, **overrides))
        return made[-1]

    monkeypatch.setattr(cli, "make_llm", recording_make_llm)

    def run(*flags: str):
        served = {}
        monkeypatch.setattr(serve_setup, "run_uvicorn", lambda app, options, *_: served.update(options, app=app))
        main(["serve", tiny_llama, "--no-engine-process", "--num-kv-blocks", "64", *flags])
        return served.pop("app"), served, made

    yield run
    for llm in made:
        assert_pool_free(llm)
