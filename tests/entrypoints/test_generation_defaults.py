"""--dtype auto (the checkpoint's dtype) and generation_config.json as the
default sampling settings, offline and over HTTP, on tiny checkpoints."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.config.engine import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.entrypoints.openai.common.protocol import ChatCompletionRequest, CompletionRequest
from tests.conftest import assert_pool_free


@pytest.fixture(scope="module")
def greedy_three_tokens(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama whose generation_config.json asks for greedy decoding and 3 new tokens."""
    folder = tmp_path_factory.mktemp("tiny-genconfig")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=3, top_k=5, top_p=1.0)  # top_p 1.0: transformers' default
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_dtype_auto_takes_the_checkpoints_dtype(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in weights.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    llm = LLM(str(tmp_path), dtype="auto", num_kv_blocks=16)
    assert llm.llm_engine.config.dtype == "bfloat16"
    assert {p.dtype for p in llm.llm_engine.model.parameters()} == {torch.bfloat16}
    out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_pool_free(llm)
    default = LLM(str(tmp_path), num_kv_blocks=16)  # the default stays float32 on this CPU
    assert {p.dtype for p in default.llm_engine.model.parameters()} == {torch.float32}


def test_generation_config_eos_token_ids_stop_generation(tiny_llama, tmp_path):
    """An end-of-turn token named only in generation_config.json stops a request
    (vLLM's rule), unless --generation-config vllm ignores the file."""
    end_of_turn = 1234
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    config["eos_token_id"] = [config.get("eos_token_id", 0), end_of_turn]
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    forced = SamplingParams(temperature=0, max_tokens=4, logit_bias={end_of_turn: 100})
    for mode, finish, length in (("auto", "stop", 1), ("vllm", "length", 4)):
        llm = LLM(str(tmp_path), num_kv_blocks=16, generation_config=mode)
        output = llm.generate("Hello", forced, use_tqdm=False)[0].outputs[0]
        assert (output.finish_reason, len(output.token_ids)) == (finish, length), mode
        assert_pool_free(llm)


def test_generation_config_sets_the_defaults_of_generate(greedy_three_tokens, caplog):
    with caplog.at_level("INFO", logger="pagedllm"):
        llm = LLM(greedy_three_tokens, num_kv_blocks=32)
    assert [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    defaults = llm.get_default_sampling_params()
    assert llm.llm_engine.default_sampling_params == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 3, 5)
    implicit = llm.generate(["Once", "Hello there"], use_tqdm=False)
    explicit = llm.generate(["Once", "Hello there"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in implicit] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) <= 3 for o in implicit)
    assert_pool_free(llm)
    ignored = LLM(greedy_three_tokens, num_kv_blocks=32, generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()
    # --override-generation-config: over the file's values, and the only ones with generation_config="vllm"
    overridden = LLM(greedy_three_tokens, num_kv_blocks=32, override_generation_config={"max_new_tokens": 7})
    assert overridden.llm_engine.default_sampling_params == {"temperature": 0.0, "top_k": 5, "max_tokens": 7}
    alone = LLM(greedy_three_tokens, num_kv_blocks=32, generation_config="vllm",
                override_generation_config={"max_new_tokens": 7})
    assert alone.get_default_sampling_params() == SamplingParams(max_tokens=7)


@pytest.mark.parametrize(("override", "message"), [
    ({"max_tokens": 7}, "unknown keys ['max_tokens']"),  # generation_config.json's name is max_new_tokens
    ({"max_new_tokens": 0}, "SamplingParams.max_tokens must be an integer >= 1"),
])
def test_override_generation_config_is_checked_before_loading(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig.from_options(override_generation_config=override)


def test_request_fields_left_unset_take_the_defaults():
    defaults = {"temperature": 0.0, "top_p": 0.5, "max_tokens": 3, "repetition_penalty": 1.2}
    unset = CompletionRequest(prompt="x").sampling_params(16, None, defaults=defaults)
    assert (unset.temperature, unset.top_p, unset.max_tokens, unset.repetition_penalty) == (0.0, 0.5, 3, 1.2)
    given = CompletionRequest(prompt="x", temperature=0.7, max_tokens=16).sampling_params(16, None, defaults=defaults)
    assert (given.temperature, given.top_p, given.max_tokens) == (0.7, 0.5, 16)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=9)
    assert chat.sampling_params(9, None, defaults=defaults).max_tokens == 9
    plain = CompletionRequest(prompt="x").sampling_params(16, None)
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)  # vLLM's own defaults without a file


def test_http_requests_without_the_fields_use_the_generation_config(greedy_three_tokens):
    llm = LLM(greedy_three_tokens, num_kv_blocks=32)
    state = ServerState(async_engine=AsyncLLMEngine(llm.llm_engine), served_model_name="tiny")
    with TestClient(build_app(state)) as client:
        messages = [{"role": "user", "content": "Say something long."}]
        first = client.post("/v1/chat/completions", json={"messages": messages, "min_tokens": 3}).json()
        second = client.post("/v1/chat/completions", json={"messages": messages, "min_tokens": 3}).json()
        assert first["usage"]["completion_tokens"] == 3 and first["choices"][0]["finish_reason"] == "length"
        assert first["choices"][0]["message"] == second["choices"][0]["message"]  # greedy: the same twice
        longer = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "min_tokens": 5}).json()
        assert longer["usage"]["completion_tokens"] == 5
    assert_pool_free(llm)
