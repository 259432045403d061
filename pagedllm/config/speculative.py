"""``speculative_config``, spelt as vLLM spells it.

A leaf module (it imports nothing of pagedllm), torch-free: ``config.engine``
validates the option with it, the scheduler reads ``num_speculative_tokens``
and the runner's ``worker/spec_decode/`` acts on the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
DRAFT_POLICIES = ("adaptive", "always")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose tokens for the target model to verify.

    - ``method="ngram"`` (prompt lookup): find the sequence's last
      ``n`` tokens earlier in its own prompt + output, for ``n`` from
      ``prompt_lookup_max`` down to ``prompt_lookup_min``, and propose the
      ``num_speculative_tokens`` tokens that followed the most recent match.
      Costs no model; pays off on text that repeats its context (code
      editing, summaries that quote, extraction).
    - ``method="draft_model"`` (the default when ``model`` is given): a
      smaller model with the same tokenizer, loaded from the local ``model``
      path like the target, proposes its ``num_speculative_tokens`` most
      likely next tokens one after another.

    ``draft_policy`` (pagedllm's, not vLLM's; n-gram only): ``"adaptive"``
    (the default) proposes a lookup only where the sequence's recent
    acceptance pays for the extra verification rows at this machine's
    measured cost per row (``pagedllm.worker.spec_decode.draft_policy``);
    ``"always"`` proposes every match, as vLLM does.
    """

    method: str | None = None  # None: draft_model when `model` is set, else ngram
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    draft_policy: str = "adaptive"

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a local checkpoint with the "
                             "target's tokenizer), and 'model' goes only with it")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"speculative_config draft_policy must be one of {', '.join(DRAFT_POLICIES)}, "
                             f"got {self.draft_policy!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_option(cls, option: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The engine option as given by ``LLM(speculative_config=...)`` (a dict,
        as vLLM takes it, or an instance), validated; None turns it off."""
        if option is None or isinstance(option, SpeculativeConfig):
            return option
        if not isinstance(option, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {type(option).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(option) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"the keys are: {', '.join(sorted(known))}")
        return cls(**option)
