"""The bodies of OpenAI responses: a whole completion, and the stream of SSE
chunks that builds the same choices piece by piece."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagedllm.entrypoints.openai.completions.choices import CompletionChoices, CompletionOptions, json_logprob
from pagedllm.entrypoints.openai.chat.output import ChatOutput
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams


class ResponseBuilder:
    """OpenAI response and chunk bodies for one API request (several prompts x n choices)."""

    def __init__(self, tokenizer: Any, kind: str, params: SamplingParams, chat: bool, model: str,
                 completion: CompletionOptions | None = None, output: ChatOutput | None = None) -> None:
        self.tokenizer = tokenizer
        # The completions side of the bodies (echo, legacy logprobs); unused by chat.
        self.completion = CompletionChoices(tokenizer, completion or CompletionOptions(), params.logprobs)
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.params = params
        self.chat = chat
        self.model = model
        self.object = "chat.completion" if chat else "text_completion"
        # Per choice: characters and tokens already streamed.
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.roles_sent: set[int] = set()
        self.chat_output = output or ChatOutput(None)
        self.hold_back = max((len(s) for s in params.stop_strings), default=1) - 1

    def _choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.params.n + completion.index

    def full(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                if not self.chat:
                    choices.append(self.completion.full_choice(self._choice_index(prompt_index, completion),
                                                               output, completion))
                    continue
                choice = {"index": self._choice_index(prompt_index, completion), "finish_reason": completion.finish_reason,
                          "logprobs": self._logprobs(completion.logprobs) if completion.logprobs is not None else None,
                          # vLLM's: the stop string or token id that ended the choice (Messages' stop_sequence)
                          "stop_reason": completion.stop_reason}
                choice["message"], choice["finish_reason"] = self.chat_output.message(completion)
                choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(finals)}

    def usage(self, finals: list[RequestOutput]) -> dict:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = sum(len(self.completion.generated(c).token_ids) for o in finals for c in o.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}

    def usage_chunk(self, finals: list[RequestOutput]) -> dict:
        return {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object,
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage(finals)}

    def chunks(self, prompt_index: int, output: RequestOutput, include_usage: bool) -> list[dict]:
        """One chunk per choice with new text (or that just finished)."""
        chunks = []
        for completion in output.outputs:
            index = self._choice_index(prompt_index, completion)
            if not self.chat:
                completion = self.completion.generated(completion)
                if self.completion.has_first_chunk and index not in self.sent_text:
                    # The echoed prompt and the prompt logprobs go first, whole, in a chunk of their own.
                    self.sent_text[index] = 0
                    chunks.append(self._chunk(self.completion.echo_choice(index, output), include_usage))
            done = completion.finish_reason is not None
            text = completion.text
            # Hold back what could still become a stop string or a partial UTF-8 character.
            visible = len(text) if done else max(0, len(text) - self.hold_back)
            while not done and visible and text[visible - 1] == "\ufffd":
                visible -= 1
            start = self.sent_text.get(index, 0)
            if visible <= start and not done:
                continue
            delta = text[start:max(start, visible)]
            self.sent_text[index] = max(start, visible)
            if self.chat:
                message_delta, finish_reason = self.chat_output.delta(index, delta, completion.finish_reason)
                if message_delta is None and index in self.roles_sent:
                    continue  # the tool parser holds it back; these tokens' logprobs go with the next chunk
            first_token = self.sent_tokens.get(index, 0)
            self.sent_tokens[index] = len(completion.token_ids)
            logprobs = None
            if completion.logprobs is not None and not self.chat:
                new_ids = completion.token_ids[first_token:]
                logprobs = self.completion.logprobs(
                    (new_ids, completion.logprobs[first_token:], start + self.completion.echo_length(output)))
            elif completion.logprobs is not None:
                logprobs = self._logprobs(completion.logprobs[first_token:])
            choice = {"index": index, "logprobs": logprobs, "finish_reason": completion.finish_reason}
            if self.chat:
                choice["delta"], choice["finish_reason"] = message_delta or {}, finish_reason
                choice["stop_reason"] = completion.stop_reason
                if index not in self.roles_sent:
                    choice["delta"]["role"] = "assistant"
                    self.roles_sent.add(index)
            else:
                choice["text"] = delta
            chunks.append(self._chunk(choice, include_usage))
        return chunks

    def _chunk(self, choice: dict, include_usage: bool) -> dict:
        chunk = {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object,
                 "created": self.created, "model": self.model, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, positions: list[PositionLogprobs]) -> dict:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]} (completions: ``CompletionChoices.logprobs``)."""
        k = self.params.logprobs or 0
        entries = []
        for entry in positions:
            chosen = next(iter(entry.items()))  # the sampler puts the sampled token first
            top = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:k]
            entries.append((chosen, top))
        def item(token_id, lp):
            text = lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([token_id])
            return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode())}
        return {"content": [{**item(*chosen), "top_logprobs": [item(*t) for t in top]} for chosen, top in entries]}
