"""Structured output (guided decoding): JSON schemas, regexes, choices and
EBNF grammars compiled with xgrammar and enforced as a per-row token bitmask."""

from pagedllm.structured_output.compiler import GrammarCompiler, StructuredOutputError
from pagedllm.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarCompiler", "StructuredOutputError", "StructuredOutputManager"]
