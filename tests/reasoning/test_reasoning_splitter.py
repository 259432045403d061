"""The reasoning parsers' split of an output into thinking and answer: whole or
fed piece by piece (as a stream arrives), the two agree."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.common.reasoning import ReasoningSettings, ReasoningSplitter


def split(text: str, starts_thinking: bool | None, piece: int | None = None) -> tuple[str | None, str]:
    """(thinking, answer) of ``text``, fed whole or ``piece`` characters at a time."""
    splitter = ReasoningSplitter(starts_thinking)
    pieces = [text] if piece is None else [text[i:i + piece] for i in range(0, len(text), piece)]
    answer = "".join(splitter.feed(p).content for p in pieces)
    end = splitter.finish()
    return splitter.reasoning, answer + end.content


@pytest.mark.parametrize(("text", "starts_thinking", "expected"), [
    ("Let me see.\n</think>\n\nThe answer.", True, ("Let me see.\n", "The answer.")),
    ("<think>\nhm</think>ok", True, ("\nhm", "ok")),  # DeepSeek-R1 writing the <think> its template opened
    ("still thinking when cut", True, ("still thinking when cut", "")),
    ("<think>a</think>b", None, ("a", "b")),  # Qwen3 opening the thinking itself
    ("  <think>a</think>  b", None, ("a", "b")),
    ("just an answer", None, (None, "just an answer")),
    ("<thin", None, (None, "<thin")),  # a tag's beginning that never completes is text
    ("<think>a</think>b", False, (None, "<think>a</think>b")),  # the prompt closed the thinking
    ("a </thi", True, ("a </thi", "")),
    ("x</think></think>y", True, ("x", "</think>y")),  # only the first end tag ends the thinking
])
@pytest.mark.parametrize("piece", [None, 1, 2, 3, 7])
def test_a_stream_splits_as_the_whole_text_does(text, starts_thinking, expected, piece):
    assert split(text, starts_thinking, piece) == expected


@pytest.fixture(scope="module")
def reasoning_tokenizer(tiny_reasoning_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_reasoning_model)


def test_where_the_output_starts_follows_the_prompt(reasoning_tokenizer):
    qwen3 = ReasoningSettings.for_tokenizer("qwen3", reasoning_tokenizer)
    r1 = ReasoningSettings.for_tokenizer("deepseek_r1", reasoning_tokenizer)
    opened = "<|im_start|>assistant\n<think>\n"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    plain = "<|im_start|>assistant\n"
    assert [qwen3.starts_thinking(p) for p in (opened, closed, plain)] == [True, False, None]
    assert [r1.starts_thinking(p) for p in (opened, closed, plain)] == [True, False, True]
    assert qwen3.gate(False) is None
    gate = qwen3.gate(None)
    assert (gate.start_token_id, gate.end_token_id, gate.thinking) == (
        reasoning_tokenizer.convert_tokens_to_ids("<think>"), reasoning_tokenizer.convert_tokens_to_ids("</think>"),
        False)


def test_a_parser_refuses_a_model_without_the_tags(smollm_tokenizer):
    with pytest.raises(ValueError, match="splits '<think>' into"):
        ReasoningSettings.for_tokenizer("qwen3", smollm_tokenizer)
    with pytest.raises(ValueError, match="not one of"):
        ReasoningSettings.for_tokenizer("granite", smollm_tokenizer)
