"""From sampled token ids to what users see: text, stop strings, logprobs,
and one RequestOutput per user request however many sequences it forked into."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.request import Request, child_request_id
from pagedllm.core.runner_output import SampledTokens
from pagedllm.engine.detokenizer import DetokenizerState, detokenize_incrementally
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class SequenceState:
    """One generated sequence (one of the n samples)."""

    request: Request
    # Output tokens folded into text and logprobs so far. A stop string cuts
    # the sequence there, even if a speculative step appended more after it.
    num_folded: int = 0
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detokenizer: DetokenizerState = field(default_factory=DetokenizerState)

    def completion(self, index: int) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=self.request.output_token_ids[: self.num_folded],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class RequestState:
    """One user request: its prompt and the sequences it became (a ``UserRequest``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sequences: dict[int, SequenceState] = field(default_factory=dict)

    streams_tokens = True  # (``UserRequest``) the output processor reports its tokens

    @property
    def num_sequences(self) -> int:
        return self.params.num_sequences

    @property
    def num_completions(self) -> int:
        return self.params.n

    def output_lengths(self) -> list[int]:
        return [len(s.request.output_token_ids) for s in self.sequences.values()]

    def own_output(self, tokenizer: Any) -> None:  # its outputs are the output processor's
        return None

    def live_sequence_ids(self) -> list[str]:
        """Ids of every sequence the request may still have in the scheduler."""
        return [child_request_id(self.request_id, i) for i in range(self.num_sequences)]

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.num_sequences and all(
            s.finish_reason is not None for s in self.sequences.values()
        )


@dataclass
class ProcessedStep:
    """What one step's tokens became: the outputs to report, and the sequences
    that matched a stop string, which the engine must finish (the scheduler
    only knows token-level stop conditions)."""

    outputs: list[RequestOutput]
    stopped_sequence_ids: list[str]


class OutputProcessor:
    """Folds sampled tokens into per-request ``RequestState``s (text, stop
    strings, logprobs) and builds RequestOutputs. It holds no registry and
    finishes nothing: the engine owns the states and acts on what
    ``process`` returns."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @staticmethod
    def new_state(request: Request, prompt: str | None) -> RequestState:
        params = request.sampling_params
        state = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
        )
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * request.num_prompt_tokens
        return state

    def decode_logprobs(self, entry: PositionLogprobs) -> PositionLogprobs:
        for token_id, logprob in entry.items():
            logprob.decoded_token = self.tokenizer.decode([token_id])
        return entry

    def store_prompt_logprobs(self, state: RequestState, first: int, entries: list[PositionLogprobs]) -> None:
        if state.prompt_logprobs is not None:
            state.prompt_logprobs[first : first + len(entries)] = [self.decode_logprobs(e) for e in entries]

    def process(
        self, advanced: list[Request], sampled: Mapping[str, SampledTokens], states: Mapping[str, RequestState]
    ) -> ProcessedStep:
        """Fold this step's tokens into the states (``states`` maps user request
        ids to them; ``sampled`` is the runner's tokens per sequence id); one
        output per user request that advanced (best_of > n requests report only
        when finished). A sequence may have advanced by several tokens
        (speculative decoding): they are folded one by one."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for request in advanced:
            state = states[request.group_id]
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            seq = state.sequences.get(request.sample_index)
            if seq is None:
                # A sequence's first step yields one token (drafts come later).
                seq = state.sequences[request.sample_index] = SequenceState(request, request.num_output_tokens - 1)
                if request.sampling_params.logprobs is not None:
                    seq.logprobs = []
            if self._fold_step(seq, sampled[request.request_id]):
                stopped.append(request.request_id)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
            elif state.params.num_sequences > state.params.n:
                continue
            outputs.append(self._request_output(state))
        return ProcessedStep(outputs, stopped)

    def _fold_step(self, seq: SequenceState, tokens: SampledTokens) -> bool:
        """Fold the tokens the sequence gained this step (``tokens[i]`` with its
        logprobs; a stop condition may have kept the last ones out of the
        sequence); True when one of them completes a stop string (the rest are dropped)."""
        output_token_ids = seq.request.output_token_ids
        for index in range(len(output_token_ids) - seq.num_folded):
            seq.num_folded += 1
            seq.cumulative_logprob += tokens.logprobs[index]
            if seq.logprobs is not None:
                seq.logprobs.append(self.decode_logprobs(tokens.position_logprobs[index]))
            done = seq.num_folded == len(output_token_ids)
            if self._update_text(seq, output_token_ids if done else output_token_ids[: seq.num_folded]):
                return True
        return False

    def _update_text(self, seq: SequenceState, token_ids: list[int]) -> bool:
        """Detokenize the new token (the last of ``token_ids``); returns True
        when the text now matches a stop string (the sequence is then finished
        with reason "stop")."""
        request = seq.request
        params = request.sampling_params
        new_text = detokenize_incrementally(self.tokenizer, token_ids, seq.detokenizer, params.skip_special_tokens)
        if seq.stop_reason is not None:
            return False  # already cut at a stop string; later tokens add nothing
        seq.text = seq.detokenizer.text
        # The scheduler's stop (EOS, length) belongs to the request's last token.
        finished = request.is_finished and len(token_ids) == request.num_output_tokens
        if not finished and new_text:
            for stop in params.stop_strings:
                # Only a match that ends in the new text is new: search from
                # where it could begin.
                index = seq.text.find(stop, max(0, len(seq.text) - len(new_text) - len(stop) + 1))
                if index != -1:
                    seq.text = seq.text[: index + len(stop) if params.include_stop_str_in_output else index]
                    seq.stop_reason = stop
                    seq.finish_reason = "stop"
                    return True
        if finished:
            seq.finish_reason = request.status.finish_reason
            if seq.stop_reason is None:
                seq.stop_reason = request.stop_reason
        return False

    def _request_output(self, state: RequestState) -> RequestOutput:
        sequences = [state.sequences[i] for i in sorted(state.sequences)]
        state.metrics.num_preemptions = sum(s.request.num_preemptions for s in sequences)
        params = state.params
        if state.finished and len(sequences) > params.n:
            # best_of: keep the n most likely samples, most likely first.
            sequences = sorted(sequences, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[seq.completion(i) for i, seq in enumerate(sequences)],
            finished=state.finished,
            metrics=state.metrics,
            num_cached_tokens=sequences[0].request.num_cached_tokens,
        )
