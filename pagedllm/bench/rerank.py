"""`pagedllm bench rerank`: one query against many documents through a decoder
yes/no reranker (Qwen3-Reranker's recipe: ``convert="classify"`` with
``classifier_from_token``), prefix caching on and off.

Every pair is rendered with the query before the document, so the documents of
one ``LLM.score`` call share the template's and the query's leading blocks: with
prefix caching the first document computes them and the others find them
cached. The table gives the prompt tokens computed against those submitted
(``num_cached_tokens`` of each output), the call's time (the best of
``rounds``, the two engines alternating, the cache emptied before each round so
each round computes the query once) and whether both engines gave the same scores.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.bench.tables import markdown_table

# vLLM's spelling of Qwen3-Reranker's recipe, for any decoder whose "no" and "yes" are one token each.
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                      "is_original_qwen3_reranker": True}
QUERY = ("Which parts of a paged KV cache can requests that begin with the same system prompt and question share, "
         "and how does the engine know which blocks are already computed?")
# Words the documents are drawn from (a document's length is what the bench varies, not its sense).
_WORDS = ("block", "cache", "prefix", "token", "request", "engine", "memory", "attention", "hash", "scheduler",
          "the", "a", "of", "is", "shares", "computes", "keeps", "frees", "every", "one", "page", "table")


@dataclass(frozen=True)
class RerankResult:
    label: str
    submitted_tokens: int
    computed_tokens: int
    seconds: float
    scores: list[float]


def documents(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """``count`` documents of ``min_words`` to ``max_words`` words, the same for a seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
            for _ in range(count)]


def run(llm: Any, label: str, query: str, docs: Sequence[str]) -> RerankResult:
    """One ``LLM.score`` of ``query`` against ``docs`` on an emptied prefix cache."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.score(query, list(docs), use_tqdm=False)
    seconds = time.perf_counter() - start
    submitted = sum(len(o.prompt_token_ids) for o in outputs)
    return RerankResult(label, submitted, submitted - sum(o.num_cached_tokens for o in outputs), seconds,
                        [o.outputs.score for o in outputs])


def measure(make: Callable[[bool], Any], query: str, docs: Sequence[str], rounds: int) -> list[RerankResult]:
    """Prefix caching on and off, ``rounds`` alternating rounds each after one warm-up; the best time each."""
    llms = {enabled: make(enabled) for enabled in (True, False)}
    best: dict[bool, RerankResult] = {}
    try:
        for llm in llms.values():
            llm.score(query, list(docs[:4]), use_tqdm=False)  # warm-up
        for _ in range(rounds):
            for enabled, llm in llms.items():
                result = run(llm, "on" if enabled else "off", query, docs)
                if enabled not in best or result.seconds < best[enabled].seconds:
                    best[enabled] = result
    finally:
        for llm in llms.values():
            llm.shutdown()
    return [best[True], best[False]]


def format_table(results: list[RerankResult]) -> str:
    baseline = results[-1]
    agree = max(abs(a - b) for a, b in zip(results[0].scores, baseline.scores))
    return markdown_table(
        ["prefix caching", "prompt tokens computed / submitted", "time (s)", "documents/s", "speed-up",
         "largest score difference to off"],
        [[r.label, f"{r.computed_tokens:,} / {r.submitted_tokens:,}", f"{r.seconds:.2f}",
          f"{len(r.scores) / r.seconds:.1f}", f"{baseline.seconds / r.seconds:.2f}x",
          f"{agree:.1e}" if r is not baseline else "-"] for r in results])
