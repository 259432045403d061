"""Chat's typed events from the engine's outputs: one ``ChoiceDelta`` per choice
with something new to say, and the whole ``ChatResult``. Every chat-based API
(chat completions, Responses, Messages) renders these."""

from __future__ import annotations

from pagedllm.entrypoints.openai.chat.events import ChatResult, ChoiceDelta, MessageDelta
from pagedllm.entrypoints.openai.chat.output import ChatOutput
from pagedllm.entrypoints.openai.common.text_cursor import TextCursor
from pagedllm.entrypoints.openai.common.usage import Usage
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

# A choice's first step while its parser still holds the text back: the role alone.
_NOTHING = MessageDelta()


class ChatChoices:
    """The choices of one chat request (several prompts x n choices, numbered in that order)."""

    def __init__(self, params: SamplingParams, output: ChatOutput) -> None:
        self.n = params.n
        self.output = output
        self.cursor = TextCursor(params)

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        """The steps of the prompt's choices with new text (or that just finished)."""
        events = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            new = self.cursor.new_text(index, completion)
            if new is None:
                continue
            message = self.output.delta(index, new[1], completion.finish_reason)
            first = index not in self.cursor.sent_tokens
            if message is None and not first:
                continue  # the tool parser holds it back; these tokens' logprobs go with the next step
            first_token = self.cursor.new_tokens(index, completion)
            logprobs = completion.logprobs[first_token:] if completion.logprobs is not None else None
            events.append(ChoiceDelta(index, first, message or _NOTHING, completion.stop_reason, logprobs))
        return events

    def result(self, finals: list[RequestOutput]) -> ChatResult:
        choices = [self.output.result(prompt_index * self.n + completion.index, completion)
                   for prompt_index, output in enumerate(finals) for completion in output.outputs]
        return ChatResult(choices, Usage.of(finals))
