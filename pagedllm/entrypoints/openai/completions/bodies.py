"""The /v1/completions bodies: a whole ``text_completion``, and the stream of
chunks that builds the same choices piece by piece."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagedllm.entrypoints.openai.common.text_cursor import TextCursor
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.entrypoints.openai.completions.choices import CompletionChoices, CompletionOptions
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class CompletionBodies:
    """The bodies of one completions request (several prompts x n choices)."""

    def __init__(self, tokenizer: Any, params: SamplingParams, model: str, options: CompletionOptions,
                 include_usage: bool) -> None:
        self.choices = CompletionChoices(tokenizer, options, params.logprobs)
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = params.n
        self.model = model
        self.include_usage = include_usage
        self.cursor = TextCursor(params)

    def full(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [self.choices.full_choice(prompt_index * self.n + completion.index, output, completion)
                   for prompt_index, output in enumerate(finals) for completion in output.outputs]
        return {**self._head(), "choices": choices, "usage": self._usage(finals).to_openai()}

    def usage_chunk(self, finals: list[RequestOutput]) -> list[dict[str, Any]]:
        """The last chunk, when the request asked for the usage."""
        if not self.include_usage:
            return []
        return [{**self._head(), "choices": [], "usage": self._usage(finals).to_openai()}]

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """One chunk per choice with new text (or that just finished)."""
        chunks = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            completion = self.choices.generated(completion)
            if self.choices.has_first_chunk and self.cursor.begin(index):
                # The echoed prompt and the prompt logprobs go first, whole, in a chunk of their own.
                chunks.append(self._chunk(self.choices.echo_choice(index, output)))
            new = self.cursor.new_text(index, completion)
            if new is None:
                continue
            start, text = new
            first_token = self.cursor.new_tokens(index, completion)
            logprobs = None
            if completion.logprobs is not None:
                logprobs = self.choices.logprobs((completion.token_ids[first_token:], completion.logprobs[first_token:],
                                                  start + self.choices.echo_length(output)))
            chunks.append(self._chunk({"index": index, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                                       "text": text}))
        return chunks

    def _usage(self, finals: list[RequestOutput]) -> Usage:
        return Usage.of(finals, self.choices.generated)

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._head(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk
