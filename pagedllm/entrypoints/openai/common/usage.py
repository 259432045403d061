"""The token counts of one API request, as every API reports them in its own words."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.outputs import CompletionOutput, RequestOutput


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache held

    @classmethod
    def of(cls, finals: list[RequestOutput],
           generated: Callable[[CompletionOutput], CompletionOutput] = lambda completion: completion) -> Usage:
        """The usage of every prompt's final output; ``generated``: the part of a choice the client is charged for."""
        return cls(sum(len(o.prompt_token_ids) for o in finals),
                   sum(len(generated(c).token_ids) for o in finals for c in o.outputs),
                   sum(o.num_cached_tokens for o in finals))

    def to_openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
