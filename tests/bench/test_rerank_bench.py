"""`pagedllm bench rerank` on a tiny random decoder reranker: with prefix caching the query's
blocks are computed once, without it every document computes them, and the scores agree."""

from __future__ import annotations

from pagedllm import LLM
from pagedllm.bench.rerank import QUERY, RERANKER_OVERRIDES, documents, format_table, measure


def test_the_query_is_computed_once_with_prefix_caching(tiny_model_dir) -> None:
    docs = documents(6, 3, 12, seed=1)
    assert docs == documents(6, 3, 12, seed=1) and len(set(docs)) == 6
    on, off = measure(lambda enabled: LLM(tiny_model_dir("qwen3"), runner="pooling", convert="classify",
                                          hf_overrides=RERANKER_OVERRIDES, enable_prefix_caching=enabled,
                                          dtype="float32", block_size=16, num_kv_blocks=64),
                      QUERY, docs, rounds=1)
    assert on.submitted_tokens == off.submitted_tokens == off.computed_tokens
    # Five of the six documents found the shared blocks (the template and the query: over 3 blocks) cached.
    assert off.computed_tokens - on.computed_tokens >= 5 * 3 * 16
    assert max(abs(a - b) for a, b in zip(on.scores, off.scores)) < 1e-5
    rows = format_table([on, off]).splitlines()
    assert rows[2].startswith(f"| on | {on.computed_tokens:,} / {on.submitted_tokens:,} |")
    assert rows[3].endswith("| 1.00x | - |")
