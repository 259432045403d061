"""Incremental detokenization must emit exactly the text a full decode gives,
through the Rust ``DecodeStream`` (fast tokenizers) and through the Python
window of decodes (every other tokenizer) alike."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.engine import detokenizer
from pagedllm.engine.detokenizer import DetokenizerState, detokenize_incrementally


@pytest.fixture(autouse=True, params=["stream", "window"])
def decode_path(request, monkeypatch):
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "stream_backend", lambda tokenizer: None)
    return request.param

SAMPLES = [
    "Hello, world! Paging the KV cache like virtual memory.",
    "Emoji 🙂🚀 and CJK 日本語の文章 and accents: café, naïve, Ærøskøbing.",
    "  leading spaces,\ttabs\nand newlines\n\n  indented code: def f(x):\n    return x",
]


def run_incrementally(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[str, list[str]]:
    state = DetokenizerState()
    deltas = [detokenize_incrementally(tokenizer, ids[: i + 1], state, skip_special_tokens) for i in range(len(ids))]
    return state.text, deltas


def test_fast_tokenizers_take_the_stream(smollm_tokenizer, decode_path):
    state = DetokenizerState()
    detokenize_incrementally(smollm_tokenizer, smollm_tokenizer.encode("Hello"), state, True)
    assert (state.stream is not None) == (decode_path == "stream")


def test_incremental_text_equals_full_decode_on_real_text(smollm_tokenizer):
    for sample in SAMPLES:
        ids = smollm_tokenizer.encode(sample)
        text, deltas = run_incrementally(smollm_tokenizer, ids)
        assert text == smollm_tokenizer.decode(ids, skip_special_tokens=True) == "".join(deltas)
        # Multi-byte characters split over tokens never leak a replacement character.
        assert all("\ufffd" not in delta for delta in deltas)


def test_special_tokens_are_skipped_or_kept_like_a_full_decode(smollm_tokenizer):
    special = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = smollm_tokenizer.encode("The answer") + [special] + smollm_tokenizer.encode(" is 42")
    for skip in (True, False):
        text, _ = run_incrementally(smollm_tokenizer, ids, skip_special_tokens=skip)
        assert text == smollm_tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_equals_full_decode_on_random_ids(smollm_tokenizer, data):
    """Random ids (byte tokens included) decode to the same text either way,
    once the last character is complete."""
    ids = data.draw(st.lists(st.integers(0, smollm_tokenizer.vocab_size - 1), min_size=1, max_size=40))
    text, _ = run_incrementally(smollm_tokenizer, ids)
    full = smollm_tokenizer.decode(ids, skip_special_tokens=True)
    if full.endswith("\ufffd"):
        # The tail is an incomplete character: it is held back, the rest agrees.
        assert full.startswith(text)
    else:
        assert text == full
