"""Compile a request's ``StructuredOutputsParams`` into an xgrammar grammar.

xgrammar (vLLM's default backend) turns JSON schemas, regular expressions and
EBNF/GBNF grammars into a pushdown automaton over the model's vocabulary;
nothing here converts a schema by hand. Compiling is done when a request is
added, so a bad schema, regex or grammar is a ``ValueError`` before the
request reaches the scheduler, never an error in the engine loop.

xgrammar is imported where a grammar is first compiled (here and in
``manager``, ``worker.sampling.grammar``), not with the package: its import
costs ~0.2 s that a run without structured outputs (a first ``generate``)
should not pay.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# With any_whitespace, a small model can emit whitespace forever between two
# JSON tokens; this bound keeps pretty-printed JSON (a newline and an indent)
# possible while making such a loop impossible.
MAX_JSON_WHITESPACE = 16

# xgrammar (0.2.9) compiles a string with minLength / maxLength to repeats of
# the first class, which admits the raw control characters U+0000-U+001F that
# JSON forbids inside strings (its unbounded strings exclude them); the second
# is the class of a valid unescaped JSON string character.
_LENGTH_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_LOCATION_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class StructuredOutputError(ValueError):
    """A constraint xgrammar cannot compile. ``kind`` is the StructuredOutputsParams
    field that holds it and ``reason`` what is wrong, so callers can name the field
    their user set (the server names the request field)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind} is invalid: {reason}")
        self.kind = kind
        self.reason = reason


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, with xgrammar's cache
    (the same schema twice compiles once).

    The tokenizer's vocabulary is analysed on the first compile, not at start-up,
    so engines that never see a guided request pay nothing. Safety rule: only
    one thread compiles (the one adding requests); matchers made from the
    compiled grammars may be used from another.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the width of the model's logits, which the mask must cover
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params``; ``StructuredOutputError`` if it is invalid."""
        kind = params.kind
        compiler = self._xgrammar_compiler()
        try:
            if kind == "json":
                return compiler.compile_grammar(json_schema_grammar(_schema_text(params.json),
                                                                    params.disable_any_whitespace))
            if kind == "json_object":
                # Any JSON object (OpenAI's json_object), with the same whitespace rule as schemas.
                return compiler.compile_grammar(json_schema_grammar('{"type": "object"}', params.disable_any_whitespace))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as exc:
            raise StructuredOutputError(kind, _LOCATION_PREFIX.sub("", str(exc).strip())) from None
        except UnicodeDecodeError:
            # xgrammar's error message, cut inside a multi-byte character, did not decode: still an invalid one.
            raise StructuredOutputError(kind, "it does not compile (xgrammar's error message was not valid "
                                              "UTF-8; look for a mistake near non-ASCII text)") from None

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


@functools.lru_cache(maxsize=256)
def json_schema_grammar(schema_text: str, disable_any_whitespace: bool) -> str:
    """xgrammar's EBNF for a JSON schema, with length-bounded strings kept to
    valid JSON string characters (see ``_LENGTH_BOUNDED_STRING_CHARACTER``).
    Cached: the server checks a request's schema before the engine compiles it,
    and clients send the same schema again and again."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema_text, **_json_format(disable_any_whitespace)))
    return ebnf.replace(_LENGTH_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``. A JSON string literal is
    also a valid xgrammar EBNF literal, so ``json.dumps`` does the escaping."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _schema_text(schema: str | dict[str, Any]) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    if not isinstance(schema, str):
        raise StructuredOutputError("json", f"a schema is a dict or its JSON text, got {type(schema).__name__}")
    try:
        json.loads(schema)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError("json", f"the schema is not JSON text: {exc}") from None
    return schema


def _json_format(disable_any_whitespace: bool) -> dict[str, Any]:
    """Whitespace in JSON output: at most MAX_JSON_WHITESPACE characters between
    tokens by default, none at all with ``disable_any_whitespace``."""
    if disable_any_whitespace:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
