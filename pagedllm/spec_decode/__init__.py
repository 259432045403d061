"""Speculative decoding: cheap proposals of the next tokens, verified by the
target model in one forward pass, so one step may yield several tokens.

``config`` (what the user asks for), ``ngram`` (prompt lookup, no extra model),
``rejection`` (verification that keeps the target distribution exactly).
"""

from pagedllm.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
