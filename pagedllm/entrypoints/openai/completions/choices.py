"""The /v1/completions side of the response bodies: the echoed prompt, OpenAI's
legacy ``logprobs`` object and vLLM's per-choice ``prompt_logprobs``.

Legacy logprobs (OpenAI / vLLM): ``tokens``, ``token_logprobs``,
``top_logprobs`` (per position the chosen token plus the ``logprobs`` most
likely, keyed by token text, so up to ``logprobs + 1`` entries) and
``text_offset`` (where each token's text starts in the choice's text). With
``echo`` the prompt's tokens come first; the first prompt token has nothing to
be predicted from, so its logprob and top_logprobs are ``null``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.common.logprobs import json_logprob
from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


@dataclass(frozen=True)
class CompletionOptions:
    """What a completions request asks of its choices beyond the generated text."""

    echo: bool = False
    # max_tokens 0 with echo: the engine runs the prefill (and samples one token,
    # which is dropped), the choice holds only the prompt.
    echo_only: bool = False
    prompt_logprobs: bool = False  # return vLLM's per-choice "prompt_logprobs"
    tokens_as_ids: bool = False  # tokens in logprobs read "token_id:<id>" (vLLM's return_tokens_as_token_ids)


class CompletionChoices:
    """Builds completions choices (whole or streamed) for one request."""

    def __init__(self, tokenizer: Any, options: CompletionOptions, num_top_logprobs: int | None) -> None:
        self.tokenizer = tokenizer
        self.options = options
        # None: the request asked for no logprobs.
        self.num_top_logprobs = num_top_logprobs

    def generated(self, completion: CompletionOutput) -> CompletionOutput:
        """The generated part the client sees: nothing at all for echo-only requests."""
        if not self.options.echo_only:
            return completion
        finish_reason = "length" if completion.finish_reason is not None else None
        return dataclasses.replace(completion, text="", token_ids=[], finish_reason=finish_reason, stop_reason=None,
                                   logprobs=[] if completion.logprobs is not None else None)

    def prompt_text(self, output: RequestOutput) -> str:
        """The echoed text: the prompt as given, or its token ids decoded."""
        return output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)

    def full_choice(self, index: int, output: RequestOutput, completion: CompletionOutput) -> dict:
        completion = self.generated(completion)
        echoed = self.prompt_text(output) if self.options.echo else ""
        choice = {"index": index, "text": echoed + completion.text, "logprobs": None,
                  "finish_reason": completion.finish_reason}
        if self.num_top_logprobs is not None:
            choice["logprobs"] = self.logprobs((*self._echoed_positions(output), 0),
                                               (completion.token_ids, completion.logprobs or [], len(echoed)))
        if self.options.prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs(output)
        return choice

    @property
    def has_first_chunk(self) -> bool:
        """Whether a stream starts each choice with ``echo_choice``."""
        return self.options.echo or self.options.prompt_logprobs

    def echo_choice(self, index: int, output: RequestOutput) -> dict:
        """A streamed choice's first chunk: the echoed prompt with its logprobs,
        and the prompt_logprobs."""
        choice = {"index": index, "text": self.prompt_text(output) if self.options.echo else "", "logprobs": None,
                  "finish_reason": None}
        if self.num_top_logprobs is not None and self.options.echo:
            choice["logprobs"] = self.logprobs((*self._echoed_positions(output), 0))
        if self.options.prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs(output)
        return choice

    def echo_length(self, output: RequestOutput) -> int:
        """Characters of the choice's text before the generated part."""
        return len(self.prompt_text(output)) if self.options.echo else 0

    def _echoed_positions(self, output: RequestOutput) -> tuple[list[int], list[PositionLogprobs | None]]:
        if not self.options.echo:
            return [], []
        # The engine computes prompt logprobs whenever echo asks for logprobs.
        return list(output.prompt_token_ids), list(output.prompt_logprobs or [None] * len(output.prompt_token_ids))

    def logprobs(self, *segments: tuple[list[int], list[PositionLogprobs | None], int]) -> dict:
        """The legacy object for runs of positions, each ``(token ids, their
        entries, where its text starts in the choice's text)``: the echoed prompt
        and the generated tokens are two runs, so the generated offsets stay
        exact even where the prompt's decoded tokens do not add up to its text."""
        num_top = self.num_top_logprobs or 0
        body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_ids, entries, at in segments:
            for token_id, entry in zip(token_ids, entries):
                chosen = entry.get(token_id) if entry is not None else None
                token = self._token(token_id, chosen)
                body["tokens"].append(token)
                body["text_offset"].append(at)
                at += len(token)
                body["token_logprobs"].append(json_logprob(chosen.logprob) if chosen is not None else None)
                if entry is None:
                    body["top_logprobs"].append(None)
                    continue
                top = sorted((kv for kv in entry.items() if kv[0] != token_id), key=lambda kv: kv[1].rank or 0)
                listed = [(token_id, chosen), *top[:num_top]]
                body["top_logprobs"].append({self._token(t, lp): json_logprob(lp.logprob) for t, lp in listed})
        return body

    def prompt_logprobs(self, output: RequestOutput) -> list[dict | None] | None:
        """vLLM's shape: per prompt token ``{token_id: {logprob, rank, decoded_token}}``, None first."""
        if output.prompt_logprobs is None:
            return None
        return [None if entry is None else {
            str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in entry.items()
        } for entry in output.prompt_logprobs]

    def _token(self, token_id: int, logprob: Logprob | None) -> str:
        if self.options.tokens_as_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])
