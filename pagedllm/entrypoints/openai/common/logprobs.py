"""Logprobs as JSON numbers, the one rule every API's logprobs follow."""

from __future__ import annotations

# JSON has no -inf: a token the sampling rules excluded (allowed_token_ids, a
# grammar) gets vLLM's floor instead, which any client reads as "impossible".
LOWEST_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """``value`` as a JSON number (-inf and NaN become ``LOWEST_LOGPROB``)."""
    return value if value > LOWEST_LOGPROB else LOWEST_LOGPROB
