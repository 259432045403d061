"""SamplingParams: how one request's tokens are chosen and when it stops.

Field names and defaults follow vLLM so code written for vLLM runs unchanged.
Every field is validated in ``__post_init__``; a bad value raises ``ValueError``
naming the field and the accepted range, before the request reaches the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, NoReturn

# Below this temperature sampling is treated as greedy: dividing logits by a
# number this small overflows fp32 and makes the softmax meaningless anyway.
_GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class ReasoningGate:
    """Where a reasoning model's thinking ends, so that a constraint shapes only
    the answer after it (the server sets it under ``--reasoning-parser``): the
    grammar masks nothing while the model thinks and starts with the token after
    ``end_token_id``.

    ``thinking``: the output starts inside the thinking (the prompt opened it).
    Otherwise the first token may be ``start_token_id`` (the model opens its
    thinking itself) or the answer's first token.
    """

    start_token_id: int
    end_token_id: int
    thinking: bool


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``):
    exactly one of the fields is set.

    - ``json``: a JSON schema (dict or its JSON text); the output is JSON valid against it.
    - ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    - ``regex``: the output matches this regular expression, whole.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF / GBNF grammar whose ``root`` rule the output matches.

    ``disable_any_whitespace`` (vLLM's option, JSON only): no whitespace at all in
    the JSON output; by default up to 16 whitespace characters may separate two
    JSON tokens (enough for pretty-printing, never an endless run of blanks).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    reasoning: ReasoningGate | None = None  # the constraint applies after the thinking (``ReasoningGate``)

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {kinds or 'none'}"
            )
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list of strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "json_object", "regex", "choice", "grammar")
                    if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules (vLLM semantics).

    - ``temperature == 0`` means greedy decoding; ``top_p``/``top_k``/``min_p`` are
      then ignored.
    - ``top_k`` of 0 or -1 disables top-k filtering.
    - ``seed`` makes the request reproducible regardless of what else is batched
      with it: the randomness of the token at output position ``i`` is derived
      from ``(seed, i)`` only.
    - ``stop`` strings are searched in the detokenized output and are not
      included in the returned text (unless ``include_stop_str_in_output``).
    - ``logprobs=k`` returns, for every generated token, the log-probability of
      the sampled token plus the ``k`` most likely tokens; ``prompt_logprobs=k``
      does the same for every prompt token after the first.
    - ``logit_bias`` ({token id: bias}, OpenAI's rule) adds each bias to that
      token's logit before sampling; biases are clamped to [-100, 100].
    - ``allowed_token_ids``: only these tokens may be sampled.
    - ``bad_words``: vLLM's rule; each word is tokenized with and without a
      leading space, and a word's last token is banned whenever the tokens
      before it end the output so far (a one-token word is always banned).
      The engine does the tokenizing (``bad_words_token_ids``).
    - ``truncate_prompt_tokens=k`` keeps only the last ``k`` prompt tokens; -1
      keeps as many as the context allows (``max_model_len - 1``).
    - Reported logprobs stay those of the raw model distribution: none of the
      rules above changes them.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Constrains the output (JSON schema, regex, choice, grammar); applied as a token mask.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Filled by the engine's input processor from bad_words (it holds the
    # tokenizer): the token sequences the sampler bans, one list per variant.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    # Filled in by __post_init__: ``stop`` normalised to a list.
    _stop_strings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.stop is None:
            self._stop_strings = []
        elif isinstance(self.stop, str):
            self._stop_strings = [self.stop]
        else:
            self._stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            # OpenAI's range; a bias beyond it would only saturate the softmax.
            self.logit_bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strings

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: ``best_of`` samples when set, else ``n``."""
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    def _validate(self) -> None:
        def fail(field_name: str, rule: str, value: object) -> NoReturn:
            raise ValueError(f"SamplingParams.{field_name} {rule}, got {value!r}")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(name, "must be a number", value)
        for name in ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                fail(name, "must be an integer, not a bool", getattr(self, name))

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1", self.n)
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            fail("best_of", f"must be an integer >= n ({self.n})", self.best_of)
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "must be > 0", self.repetition_penalty)
        if not self.temperature >= 0.0:
            fail("temperature", "must be >= 0 (0 means greedy)", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "must be an integer >= 1, or 0 / -1 to disable", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer or None", self.seed)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", "must be an integer >= 0 or None", self.logprobs)
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            fail("prompt_logprobs", "must be an integer >= 0 or None", self.prompt_logprobs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "must be a StructuredOutputsParams", self.structured_outputs)
        self._validate_token_rules(fail)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in stops):
            fail("stop", "must be a non-empty string or a list of non-empty strings", self.stop)
        if self.stop_token_ids is not None and any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "must be a list of non-negative token ids", self.stop_token_ids)

    def _validate_token_rules(self, fail: Callable[[str, str, object], NoReturn]) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens; the
        vocabulary bounds are checked by the engine, which knows the vocabulary."""

        def is_token_id(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        def is_number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict) or not all(is_token_id(t) and is_number(b) for t, b in bias.items())
        ):
            fail("logit_bias", "must map token ids (integers >= 0) to finite numbers", bias)
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or not all(map(is_token_id, allowed))):
            fail("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)", allowed)
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            fail("bad_words", "must be a list of non-blank strings", words)
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (
            isinstance(truncate, bool) or not isinstance(truncate, int) or (truncate < 1 and truncate != -1)
        ):
            fail("truncate_prompt_tokens", "must be an integer >= 1, or -1 (as many as the context allows)", truncate)
