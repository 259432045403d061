"""The wire contract between API processes and the engine-core process.

Everything that crosses the ZMQ boundary is one of these msgspec Structs,
encoded as MessagePack (tagged unions, array-like where the field names would
cost more than the values). Requests carry ``SamplingParams`` as it is (a
dataclass msgspec encodes field by field and rebuilds, validation included);
outputs travel as deltas (``output_deltas``), so a token costs a few bytes
however long its sequence is. Nothing here imports torch.

The conversation, per API process (a ZMQ DEALER) with the core (a ROUTER):

- ``Hello`` -> ``Ready`` (the core's fixed facts). A client repeats ``Hello``
  until it is answered: the core may still be loading, or restarting.
- ``AddRequest`` -> ``AddResult`` (after the core validated and queued it, or
  the ``RequestError`` that refused it), then ``OutputBatch``es.
- ``AbortRequests`` (no answer: the core frees the blocks before its next step).
- ``UtilityCall`` -> ``UtilityResult`` (stats, the pool snapshot, metrics...).
- ``EngineFailed``: the core's step raised; every request of the core failed
  and the core process exits.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec

from pagedllm.config.pooling import PoolerSpec
from pagedllm.core.runner_output import PooledOutput
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.wire import WireFeature
from pagedllm.outputs import Logprob
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class Hello(msgspec.Struct, tag="hello", array_like=True):
    client_name: str


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt: str | list[int] | dict[str, Any]
    params: SamplingParams | None = None
    beam: BeamSearchParams | None = None  # a beam search instead of sampling
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    pooling: PoolingParams | None = None  # a pooling request instead of sampling
    mm_features: list[WireFeature] | None = None  # the prompt's processed images (the API process ran the processor)

    def __post_init__(self) -> None:
        # A JSON schema (a request's, or a tool's parameters) travels as its JSON text: msgpack
        # carries no integer beyond 64 bits, which a schema may hold (the compiler reads either).
        guided = self.params.structured_outputs if self.params is not None else None
        if guided is not None and isinstance(guided.json, dict):
            self.params = dataclasses.replace(
                self.params, structured_outputs=dataclasses.replace(guided, json=json.dumps(guided.json)))


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str  # one of ``core_process.UTILITY_METHODS``
    args: list[Any] = []


EngineCoreInput = Hello | AddRequest | AbortRequests | UtilityCall


class EngineFacts(msgspec.Struct, array_like=True):
    """What an API process needs to know of the engine (``EngineInfo`` without
    the objects that cannot travel: the tokenizer travels pickled)."""

    pid: int
    tokenizer_pickle: bytes
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_seqs: int
    max_logprobs: int
    scheduling_policy: str
    default_sampling_params: dict[str, Any]
    capacity_line: str
    pooler_spec: PoolerSpec | None = None  # a pooling engine's tasks
    multimodal_pickle: bytes | None = None  # a vision-language model's ImagePromptProcessor, pickled


class Ready(msgspec.Struct, tag="ready", array_like=True):
    facts: EngineFacts


class RequestError(msgspec.Struct, array_like=True):
    """Why a request was refused: ``ValueError``'s message, or a structured-output
    constraint's field (``kind``) and reason, which the server names in its 400."""

    message: str
    structured_output_kind: str | None = None
    structured_output_reason: str | None = None


class AddResult(msgspec.Struct, tag="added", array_like=True):
    request_id: str
    error: RequestError | None = None


class CompletionDelta(msgspec.Struct, array_like=True):
    """One sequence's change since the last delta sent for it: ``text`` replaces
    the sequence's text from ``text_start`` on (text only grows, except where a
    stop string cuts what was streamed); tokens and logprobs are appended."""

    index: int
    text_start: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class PromptFacts(msgspec.Struct, array_like=True):
    """A request's prompt as the core ran it (maybe truncated): sent with its first output."""

    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None


class OutputDelta(msgspec.Struct, array_like=True):
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    metrics: list[float | int | None]  # RequestMetrics' fields in order (names would cost more than values)
    num_cached_tokens: int
    prompt: PromptFacts | None = None  # with the first delta of a request only
    pooled: PooledOutput | None = None  # a pooling request's one (finished) result, in place of completions


class OutputBatch(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[OutputDelta]


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    value: Any = None
    error: str | None = None


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class RequestsDropped(msgspec.Struct, tag="dropped", array_like=True):
    """Requests the core aborted because a message to their API client could not be
    queued (it stopped reading): sent once that client can take messages again, so
    its streams end with an error instead of waiting for outputs that will not come."""

    request_ids: list[str]
    reason: str


EngineCoreOutput = Ready | AddResult | OutputBatch | UtilityResult | EngineFailed | RequestsDropped


def input_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    """(encoder, decoder of ``EngineCoreInput``): one pair per socket owner (not thread-safe)."""
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreInput)


def output_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    """(encoder, decoder of ``EngineCoreOutput``): one pair per socket owner (not thread-safe)."""
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutput)
