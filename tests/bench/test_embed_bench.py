"""`pagedllm bench embed`: its passages, its agreement column and its table (the run itself is
exercised by the end-to-end test at the bottom, on the real all-MiniLM-L6-v2)."""

from __future__ import annotations

import pytest

from pagedllm.bench.embed import EmbedResult, format_table, min_cosine, passages


def test_passages_have_the_asked_lengths_in_tokens(minilm_folder) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder)
    texts = passages(tokenizer, 200, 10, 256, seed=3)
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    # Decoding and re-tokenizing whole words gives the target back, give or take a split word.
    assert min(lengths) >= 9 and max(lengths) <= 258
    assert max(lengths) - min(lengths) > 200  # mixed, not one length
    assert passages(tokenizer, 5, 10, 20, seed=3) == passages(tokenizer, 5, 10, 20, seed=3)


def test_min_cosine_finds_the_worst_pair() -> None:
    reference = [[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]]
    assert min_cosine(reference, reference) == pytest.approx(1.0)
    turned = [[1.0, 0.0], [1.0, 1.0], [3.0, 4.0]]  # the second is 45 degrees off
    assert min_cosine(turned, reference) == pytest.approx(2 ** -0.5)


def test_table_gives_ratios_against_the_first_row() -> None:
    vectors = [[1.0, 0.0]]
    table = format_table([EmbedResult("sentence-transformers", 4.0, vectors, "batch 64"),
                          EmbedResult("pagedllm LLM.embed", 2.0, vectors)], num_texts=100)
    rows = table.splitlines()
    assert "| sentence-transformers | batch 64 | 4.00 | 25 | 1.00x | 1.000000 |" in rows
    assert "| pagedllm LLM.embed |  | 2.00 | 50 | 2.00x | 1.000000 |" in rows
