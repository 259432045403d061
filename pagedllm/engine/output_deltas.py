"""RequestOutputs as deltas across the process boundary, and back.

The engine reports a request's whole state each step (its text and tokens so
far). Sending that would cost O(length) per token; ``DeltaEncoder`` (in the
core) sends what changed since the last send, and ``OutputAssembler`` (in the
API process) folds the deltas back into the same RequestOutputs the engine
made, field for field.

Rule both sides rely on: what was sent for a sequence index is a prefix of its
later state, tokens and logprobs always, text except where a stop string cuts
it (``text_start`` says where the new text begins). The output processor keeps
it: best_of requests, whose ranking reorders sequences, report only once
finished, and beam searches report once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pagedllm.engine.core_messages import CompletionDelta, OutputDelta, PromptFacts
from pagedllm.core.runner_output import PooledOutput
from pagedllm.engine.pooling_request import pooling_output
from pagedllm.outputs import CompletionOutput, PoolingRequestOutput, PositionLogprobs, RequestMetrics, RequestOutput

_METRIC_FIELDS = tuple(f.name for f in fields(RequestMetrics))


@dataclass
class _SentSequence:
    num_tokens: int = 0
    num_logprobs: int = 0
    text: str = ""


class DeltaEncoder:
    """Core side: one per engine; remembers what was sent per live request.

    Safety rule: every request it saw must end in a finished output or in
    ``forget`` (an abort), or its record stays."""

    def __init__(self) -> None:
        self._sent: dict[str, list[_SentSequence]] = {}

    def encode(self, output: RequestOutput | PoolingRequestOutput) -> OutputDelta:
        if isinstance(output, PoolingRequestOutput):  # one finished result: all of it, at once
            prompt = PromptFacts(output.prompt, output.prompt_token_ids, None)
            metrics = [getattr(output.metrics, name) for name in _METRIC_FIELDS]
            data = output.outputs.data.contiguous()
            return OutputDelta(output.request_id, [], True, metrics, output.num_cached_tokens, prompt,
                               PooledOutput(data.numpy().tobytes(), tuple(data.shape)))
        sent = self._sent.get(output.request_id)
        prompt = None
        if sent is None:
            sent = self._sent[output.request_id] = []
            prompt = PromptFacts(output.prompt, output.prompt_token_ids, output.prompt_logprobs)
        completions = []
        for completion in output.outputs:
            while len(sent) <= completion.index:
                sent.append(_SentSequence())
            completions.append(self._delta(completion, sent[completion.index]))
        if output.finished:
            del self._sent[output.request_id]
        metrics = [getattr(output.metrics, name) for name in _METRIC_FIELDS]
        return OutputDelta(output.request_id, completions, output.finished, metrics, output.num_cached_tokens, prompt)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    @staticmethod
    def _delta(completion: CompletionOutput, sent: _SentSequence) -> CompletionDelta:
        text = completion.text
        # Appended text (the usual case) sends only the tail; a cut sends from the cut.
        text_start = len(sent.text) if text.startswith(sent.text) else _common_prefix_length(text, sent.text)
        logprobs = completion.logprobs[sent.num_logprobs:] if completion.logprobs is not None else None
        delta = CompletionDelta(completion.index, text_start, text[text_start:], completion.token_ids[sent.num_tokens:],
                                logprobs, completion.cumulative_logprob, completion.finish_reason,
                                completion.stop_reason)
        sent.num_tokens = len(completion.token_ids)
        sent.num_logprobs = len(completion.logprobs) if completion.logprobs is not None else 0
        sent.text = text
        return delta


def _common_prefix_length(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


@dataclass
class _AssembledSequence:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class _AssembledRequest:
    prompt: PromptFacts
    sequences: list[_AssembledSequence] = field(default_factory=list)


class OutputAssembler:
    """API side: folds each request's deltas into RequestOutputs, as the engine made them.

    Safety rule: the first delta of a request must be the first it sees (it
    carries the prompt); ``forget`` drops an aborted request's state."""

    def __init__(self) -> None:
        self._requests: dict[str, _AssembledRequest] = {}

    def assemble(self, delta: OutputDelta) -> RequestOutput | PoolingRequestOutput:
        if delta.pooled is not None:
            return pooling_output(delta.request_id, delta.pooled, delta.prompt.prompt, delta.prompt.prompt_token_ids,
                                  delta.num_cached_tokens, RequestMetrics(*delta.metrics))
        state = self._requests.get(delta.request_id)
        if state is None:
            if delta.prompt is None:
                raise ValueError(f"request {delta.request_id}: a delta came before the request's first output")
            state = self._requests[delta.request_id] = _AssembledRequest(delta.prompt)
        outputs = [self._apply(completion, state) for completion in delta.completions]
        if delta.finished:
            del self._requests[delta.request_id]
        prompt = state.prompt
        return RequestOutput(delta.request_id, prompt.prompt, prompt.prompt_token_ids, prompt.prompt_logprobs,
                             outputs, delta.finished, RequestMetrics(*delta.metrics), delta.num_cached_tokens)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @staticmethod
    def _apply(delta: CompletionDelta, state: _AssembledRequest) -> CompletionOutput:
        while len(state.sequences) <= delta.index:
            state.sequences.append(_AssembledSequence())
        sequence = state.sequences[delta.index]
        sequence.text = sequence.text[: delta.text_start] + delta.text
        sequence.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if sequence.logprobs is None:
                sequence.logprobs = []
            sequence.logprobs.extend(delta.logprobs)
        # Copies, as the engine's outputs are: a consumer may keep an earlier output.
        return CompletionOutput(delta.index, sequence.text, list(sequence.token_ids), delta.cumulative_logprob,
                                list(sequence.logprobs) if sequence.logprobs is not None else None,
                                delta.finish_reason, delta.stop_reason)
