"""Pooling options (vLLM's names): which runner an engine is, and how a generative
checkpoint is pooled. Flat engine options (``LLM(model, runner="pooling")``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pagedllm.config.cache import check_choice

Runner = Literal["generate", "pooling", "auto"]
Convert = Literal["auto", "embed", "classify"]
# The hf_overrides keys a pooling engine reads (vLLM's spelling of Qwen3-Reranker's recipe).
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")


@dataclass(frozen=True)
class PoolingConfig:
    runner: Runner = field(
        default="generate",
        metadata={"help": "generate: sampled text; pooling: embed / classify / score / encode requests "
                          "(LLM.embed ...); auto: pooling for a sequence classifier or an encoder checkpoint"},
    )
    convert: Convert = field(
        default="auto",
        metadata={"help": "how a pooling runner pools a generative checkpoint: embed (last-token embeddings), "
                          "classify (with hf_overrides' classifier_from_token, a yes/no reranker); auto: embed"},
    )
    hf_overrides: dict | None = field(
        default=None,
        metadata={"help": "vLLM's reranker recipe, e.g. '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                          "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'"},
    )

    def __post_init__(self) -> None:
        check_choice("runner", self.runner, Runner)
        check_choice("convert", self.convert, Convert)
        overrides = self.hf_overrides or {}
        unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
        if unknown:
            raise ValueError(f"hf_overrides: unknown keys {unknown}; it takes {list(HF_OVERRIDE_KEYS)}")
        tokens = overrides.get("classifier_from_token")
        if tokens is not None and (not isinstance(tokens, (list, tuple)) or len(tokens) != 2
                                   or not all(isinstance(t, str) for t in tokens)):
            raise ValueError(f"hf_overrides classifier_from_token must be two token strings [no, yes], got {tokens!r}")

    @property
    def classifier_from_token(self) -> tuple[str, str] | None:
        """The ``(no, yes)`` tokens of a yes/no reranker (None: not one)."""
        tokens: Any = (self.hf_overrides or {}).get("classifier_from_token")
        return None if tokens is None else (tokens[0], tokens[1])


@dataclass(frozen=True)
class InstructionPrompts:
    """A model's named instruction prompts, as sentence-transformers reads them
    (``config_sentence_transformers.json``'s ``prompts`` and ``default_prompt_name``),
    and whether its pooling includes their tokens (the Pooling config's ``include_prompt``)."""

    prompts: tuple[tuple[str, str], ...] = ()  # (name, text) pairs: plain data that crosses to the core
    default_prompt_name: str | None = None
    include_prompt: bool = True

    def resolve(self, prompt_name: str | None, instruction: str | None) -> str:
        """The text put before each input, as ``SentenceTransformer.encode`` picks it: ``instruction``
        when given, else the prompt named ``prompt_name``, else the default prompt ("": none)."""
        named = dict(self.prompts)
        if instruction is not None:
            if prompt_name is not None:
                raise ValueError("pass prompt_name or instruction, not both")
            return instruction
        if prompt_name is not None:
            if prompt_name not in named:
                raise ValueError(f"prompt_name {prompt_name!r} is not one of this model's prompts "
                                 f"({', '.join(map(repr, named)) or 'it names none'}: its "
                                 "config_sentence_transformers.json lists them)")
            return named[prompt_name]
        return named.get(self.default_prompt_name, "") if self.default_prompt_name is not None else ""


@dataclass(frozen=True)
class PoolerSpec:
    """What the loaded decoder pools (plain data, decided once at start-up).

    ``tasks``: the tasks it serves. ``classifier_token_ids``: ``(no, yes)`` token
    ids of a yes/no reranker, whose one label is read from the LM head; None for
    a ``score``-head classifier or an embedder. ``prompts``: an embedder's
    instruction prompts; ``normalize``: whether its embeddings are L2-normalized
    when a request leaves ``normalize`` unset (its sentence-transformers folder's
    Normalize module; yes without such a folder)."""

    tasks: tuple[str, ...]
    classifier_token_ids: tuple[int, int] | None = None
    prompts: InstructionPrompts = InstructionPrompts()
    normalize: bool = True
