"""Decoder pooling with tensor parallelism: rank 0 pools (as it samples) from the
all-reduced hidden states; a classifier's ``score`` head is whole on every rank."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.conftest import assert_pool_free
from tests.pooling.test_decoder_pooling import ENGINE, _classifier_dir, _texts


@pytest.mark.parametrize("method", ["classify", "embed"])
def test_tensor_parallel_pooling_matches_one_rank(tmp_path_factory, smollm_tokenizer, tiny_model_dir, method):
    folder = _classifier_dir(tmp_path_factory, smollm_tokenizer, "qwen2", 3) if method == "classify" \
        else tiny_model_dir("qwen2")
    texts = _texts()
    single = LLM(folder, runner="pooling", **ENGINE)
    expected = getattr(single, method)(texts, use_tqdm=False)
    assert_pool_free(single)
    single.shutdown()
    tp = LLM(folder, runner="pooling", tensor_parallel_size=2, **ENGINE)
    try:
        got = getattr(tp, method)(texts, use_tqdm=False)
        field = "probs" if method == "classify" else "embedding"
        for a, b in zip(got, expected):
            assert torch.allclose(torch.tensor(getattr(a.outputs, field)), torch.tensor(getattr(b.outputs, field)),
                                  atol=1e-5)
        assert_pool_free(tp)
    finally:
        tp.shutdown()
