"""Structured output on the HTTP endpoints: the request's constraint is built
and compiled before the request is queued, so an invalid one is a 400 that
names the request field the client set (``response_format``, ``guided_json``,
...) and says what is wrong."""

from __future__ import annotations

from pagedllm.engine.client import AsyncEngineClient
from pagedllm.entrypoints.openai.common.errors import RequestFieldError
from pagedllm.entrypoints.openai.common.protocol import _SamplingFields
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputError


def check_structured_outputs(engine: AsyncEngineClient, body: _SamplingFields, params: SamplingParams) -> None:
    """Raise ``ValueError`` (a ``RequestFieldError`` naming the request field when
    it is the constraint's fault) unless the engine can enforce the constraint
    ``params`` carries. The compiled grammar is cached, so adding the request
    does not compile it again."""
    field = body.structured_output_field()
    if field is None:
        return
    try:
        engine.compile_structured_outputs(params)
    except StructuredOutputError as exc:
        raise RequestFieldError(field, f"{field} is invalid: {exc.reason}") from exc
