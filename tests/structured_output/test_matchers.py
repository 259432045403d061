"""The StructuredOutputManager against hand-made scheduler outputs: masks per
sample row, forks, rejected tokens and release."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from pagedllm.core.runner_output import SampledTokens
from pagedllm.core.scheduler_output import SampleRow, ScheduledSequence, SchedulerOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import StructuredOutputManager


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def step(sequence_id: str, position: int, fork_ids: list[str] = ()) -> SchedulerOutput:
    rows = [SampleRow(sid, 0, position) for sid in [sequence_id, *fork_ids]]
    return SchedulerOutput(scheduled=[ScheduledSequence(sequence_id, 10, 1, sample_rows=rows)])


@pytest.fixture
def manager(smollm_tokenizer):
    return StructuredOutputManager(smollm_tokenizer, len(smollm_tokenizer), [smollm_tokenizer.eos_token_id])


def token(tokenizer, text: str) -> int:
    (token_id,) = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def one(token_id: int) -> SampledTokens:
    """What the runner reports for a row that sampled one token (no speculation)."""
    return SampledTokens([token_id], [0.0], [None])


def test_forks_copy_the_state_then_advance_apart(manager, smollm_tokenizer):
    vocab, eos = len(smollm_tokenizer), smollm_tokenizer.eos_token_id
    grammar = manager.compile(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["xy", "zw"])))
    manager.add_sequence("r", grammar)
    first = manager.bitmask_for(step("r", 0, ["r::1", "r::2"]))
    assert first.sequence_ids == ["r", "r::1", "r::2"]
    masks = [allowed_tokens(first.bitmask, i, vocab) for i in range(3)]
    x, z = token(smollm_tokenizer, "x"), token(smollm_tokenizer, "z")
    assert masks[0] == masks[1] == masks[2] and {x, z} <= masks[0] and eos not in masks[0]
    manager.accept(step("r", 0, ["r::1", "r::2"]), {"r": one(x), "r::1": one(z), "r::2": one(x)})
    assert manager.num_live_matchers == 3
    after = manager.bitmask_for(SchedulerOutput(scheduled=[
        ScheduledSequence(sid, 11, 1, sample_rows=[SampleRow(sid, 0, 1)]) for sid in ("r", "r::1")
    ]))
    assert allowed_tokens(after.bitmask, 0, vocab) == {token(smollm_tokenizer, "y")}
    assert allowed_tokens(after.bitmask, 1, vocab) == {token(smollm_tokenizer, "w")}
    manager.retain({"r::1"})
    assert manager.num_live_matchers == 1


def test_a_rejected_token_leaves_only_eos(manager, smollm_tokenizer):
    vocab, eos = len(smollm_tokenizer), smollm_tokenizer.eos_token_id
    manager.add_sequence("r", manager.compile(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))))
    manager.accept(step("r", 0), {"r": one(token(smollm_tokenizer, "b"))})
    assert allowed_tokens(manager.bitmask_for(step("r", 1)).bitmask, 0, vocab) == {eos}


def test_a_row_that_skips_a_token_is_a_loud_error(manager):
    manager.add_sequence("r", manager.compile(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))))
    with pytest.raises(RuntimeError, match="covers 0 tokens but the row samples output position 3"):
        manager.bitmask_for(step("r", 3))


def test_unguided_steps_build_no_bitmask(manager):
    assert manager.bitmask_for(step("free", 0)) is None
    assert manager.compile(SamplingParams()) is None


def test_length_bounded_json_strings_refuse_raw_control_characters(manager, smollm_tokenizer):
    """xgrammar alone lets a string with maxLength hold a raw U+0008, which no JSON
    parser accepts; the compiled grammar must not."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]}
    grammar = manager.compile(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    for text, valid in (('{"a": "ab\x08"}', False), ('{"a": "a\tb"}', False), ('{"a": "abcde"}', True),
                        ('{"a": "abcdef"}', False), ('{"a": "é"}', True)):
        matcher = xgr.GrammarMatcher(grammar)
        complete = matcher.accept_string(text) and matcher.accept_token(smollm_tokenizer.eos_token_id)
        assert complete == valid, text
