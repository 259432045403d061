"""What runs the pooling routes' inputs: a decoder's through the engine client (each
input a request with ``PoolingParams``: concurrent requests batch in the engine's
steps, through the pool and the prefix cache), an encoder's through
``EncoderBatcher`` (``encoder_batcher.py``). Both build their inputs with the
offline API's one code path (``entrypoints/pooling_inputs.py``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Protocol

from pagedllm.entrypoints.openai.common.errors import APIError
from pagedllm.entrypoints.openai.common.generation import finals
from pagedllm.entrypoints.openai.common.state import ServerState
from pagedllm.entrypoints.pooling_api import PooledResult
from pagedllm.entrypoints.pooling_inputs import PooledPrompt, PoolingInputs

# What a pooling route on a generation server says to change.
START_POOLING = "start the server with --runner pooling"


class PoolingService(Protocol):
    """The pooling side of a server: how its inputs are built and what runs them."""

    inputs: PoolingInputs

    async def run(self, inputs: list[PooledPrompt], cache_salt: str | None) -> list[PooledResult]:
        """One result per input, in order."""


class EnginePooling:
    """A decoder's pooling requests on the server's ``AsyncEngineClient``."""

    def __init__(self, state: ServerState) -> None:
        info = state.engine_info
        self.engine = state.async_engine
        self.inputs = PoolingInputs.of_decoder(info.tokenizer, info.pooler_spec, info.max_model_len, START_POOLING)

    async def run(self, inputs: list[PooledPrompt], cache_salt: str | None) -> list[PooledResult]:
        streams = []
        try:
            for item in inputs:
                rid = self.engine.next_request_id("pool")
                prompt = {"prompt_token_ids": item.token_ids, "prompt": item.prompt}
                streams.append(await self.engine.add_request(rid, prompt, item.params, cache_salt=cache_salt))
        except ValueError as exc:
            for stream in streams:
                stream.abort()
            raise APIError(400, str(exc)) from exc
        outputs = await finals(streams)
        return [PooledResult(out.request_id, out.outputs.data, out.num_cached_tokens) for out in outputs]


def pooling_service(state: ServerState) -> PoolingService:
    """The server's pooling service: an encoder server's batcher (its client's ``pooling``), else the
    engine's pooling requests (made once)."""
    if state.pooling_service is None:
        state.pooling_service = getattr(state.async_engine, "pooling", None) or EnginePooling(state)
    return state.pooling_service


def class_labels(state: ServerState, num_classes: int) -> list[str]:
    """The class names of the model's ``config.json`` ``id2label`` (``LABEL_i`` where it has none)."""
    labels = _id2label(state.model_root)
    return [str(labels.get(str(i), f"LABEL_{i}")) for i in range(num_classes)]


@functools.cache
def _id2label(model_root: str | None) -> dict[str, str]:
    """A checkpoint folder's ``id2label`` (read once: the served model does not change)."""
    config = None if model_root is None else Path(model_root) / "config.json"
    if config is None or not config.is_file():
        return {}
    return json.loads(config.read_text()).get("id2label") or {}


def prompt_list(value: Any) -> list[Any]:
    """OpenAI's ``input``: a string, strings, token ids, or token-id lists, as a list of prompts."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input must not be empty; pass a string, strings or token ids", param="input")
    if all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)
