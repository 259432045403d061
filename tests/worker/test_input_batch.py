"""The persistent input batch applies the scheduler's diffs and gathers a
step's inputs exactly as rebuilding them from each sequence's full state would."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.core.scheduler_output import NewSequenceData, ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch

BLOCK_SIZE = 4


def new_sequence(sequence_id: str, prompt: list[int], blocks: list[int] | list[list[int]],
                 outputs: list[int] | None = None):
    """``blocks``: one group's table, or each group's (lists)."""
    tables = [list(table) for table in blocks] if blocks and isinstance(blocks[0], list) else [list(blocks)]
    return NewSequenceData(sequence_id, prompt, list(outputs or []), tables, SamplingParams())


def expected_inputs(tokens: list[int], table: list[int], start: int, count: int):
    """Token ids, positions and slots of span [start, start + count) from the full state."""
    positions = list(range(start, start + count))
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    return tokens[start : start + count], positions, slots


def gather(batch: InputBatch, spans: list[tuple[str, int, int]]):
    rows = np.array([batch.sequences[s].row for s, _, _ in spans])
    starts = np.array([start for _, start, _ in spans])
    counts = np.array([count for _, _, count in spans])
    return batch.gather(rows, starts, counts)


def test_diffs_and_gather_match_the_full_state():
    batch = InputBatch(max_num_seqs=2, max_model_len=8, block_size=BLOCK_SIZE)
    batch.add(new_sequence("a", [1, 2, 3, 4, 5], [7, 3]))
    batch.add(new_sequence("b", [9, 8], [5], outputs=[6]))
    batch.apply([ScheduledSequence("a", 5, 1, new_token_ids=[11], new_block_ids=[])])
    batch.apply([ScheduledSequence("b", 1, 2, replaced_blocks=[(0, 0, 12)])])
    assert batch.sequences["a"].output_token_ids == [11]
    assert batch.block_ids("b") == [12]

    arrays = gather(batch, [("a", 5, 1), ("b", 1, 2)])
    ids_a, pos_a, slots_a = expected_inputs([1, 2, 3, 4, 5, 11], [7, 3], 5, 1)
    ids_b, pos_b, slots_b = expected_inputs([9, 8, 6], [12], 1, 2)
    assert arrays.input_ids.tolist() == ids_a + ids_b
    assert arrays.positions.tolist() == pos_a + pos_b
    assert arrays.slot_mapping.tolist() == slots_a + slots_b
    assert arrays.last_rows.tolist() == [0, 2]
    assert arrays.context_lens.tolist() == [6, 3]
    assert arrays.num_blocks.tolist() == [2, 1]


def test_truncation_and_drafts():
    batch = InputBatch(max_num_seqs=1, max_model_len=16, block_size=BLOCK_SIZE)
    batch.add(new_sequence("s", [1, 2, 3, 4, 5, 6], [10, 11, 12]))
    # Drafts 40, 41 follow the known tokens 1..6 and 7 (appended this step).
    batch.apply([ScheduledSequence("s", 6, 3, new_token_ids=[7], draft_token_ids=[40, 41])])
    arrays = gather(batch, [("s", 6, 3)])
    assert arrays.input_ids.tolist() == [7, 40, 41]
    assert arrays.positions.tolist() == [6, 7, 8]
    assert arrays.slot_mapping.tolist() == [11 * 4 + 2, 11 * 4 + 3, 12 * 4 + 0]
    # Drafts never join the history: one was accepted (8), the table rolls back to 2 entries
    # and gets a fresh third block.
    batch.apply([ScheduledSequence("s", 8, 1, new_token_ids=[40, 8], new_block_ids=[[20]], truncated_table_length=2)])
    assert batch.sequences["s"].output_token_ids == [7, 40, 8]
    assert batch.block_ids("s") == [10, 11, 20]
    arrays = gather(batch, [("s", 8, 1)])
    assert arrays.input_ids.tolist() == [8] and arrays.slot_mapping.tolist() == [20 * 4]
    # A truncation past the table or drafts that skip known tokens are refused.
    with pytest.raises(ValueError, match="truncated_table_length"):
        batch.apply([ScheduledSequence("s", 9, 1, truncated_table_length=4)])
    with pytest.raises(ValueError, match="drafts"):
        batch.apply([ScheduledSequence("s", 9, 1, new_token_ids=[9]),
                     ScheduledSequence("s", 5, 3, draft_token_ids=[1, 2])])
    # A refused step changes nothing, not even the diffs listed before the bad one.
    assert batch.sequences["s"].output_token_ids == [7, 40, 8]
    assert batch.block_ids("s") == [10, 11, 20]


def test_released_rows_are_reused_clean_and_the_batch_grows():
    batch = InputBatch(max_num_seqs=1, max_model_len=4, block_size=BLOCK_SIZE)
    batch.add(new_sequence("a", [1, 2, 3], [5]))
    batch.apply([ScheduledSequence("a", 3, 1, new_block_ids=[[6, 7]])])
    batch.release("a")
    batch.add(new_sequence("b", [4], [8]))
    # The reused row carries no entry of a's table past b's own.
    assert batch.decode_tables(np.array([batch.sequences["b"].row]), 3).tolist() == [[8, 0, 0]]
    batch.add(new_sequence("c", list(range(1, 11)), [1, 2, 3]))  # a second row, longer than max_model_len
    arrays = gather(batch, [("b", 0, 1), ("c", 0, 10)])
    assert arrays.input_ids.tolist() == [4] + list(range(1, 11))
    assert batch.block_ids("b") == [8] and batch.block_ids("c") == [1, 2, 3]


@pytest.mark.parametrize("num_groups", [1, 3])
def test_random_diffs_match_a_list_model(num_groups):
    """Free-running: random appends, block growth, replacements (of one group's
    entry, some by the null block as a window releases it), truncations and
    releases, checked against plain lists of every group's table after every step."""
    rng = random.Random(num_groups)
    batch = InputBatch(max_num_seqs=2, max_model_len=8, block_size=BLOCK_SIZE, num_groups=num_groups)
    model: dict[str, tuple[list[int], list[list[int]]]] = {}

    def blocks(count: int) -> list[list[int]]:
        return [[rng.randrange(0, 99) for _ in range(count)] for _ in range(num_groups)]

    for step in range(300):
        if len(model) < 5 and rng.random() < 0.3:
            sid = f"s{step}"
            tokens = [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
            tables = blocks(-(-len(tokens) // BLOCK_SIZE))
            model[sid] = (tokens, tables)
            batch.add(new_sequence(sid, list(tokens), tables))
        elif model and rng.random() < 0.1:
            sid = rng.choice(sorted(model))
            del model[sid]
            batch.release(sid)
        diffs = []
        for sid, (tokens, tables) in sorted(model.items()):
            new = [rng.randrange(1000) for _ in range(rng.randint(0, 2))]
            tokens.extend(new)
            cut = rng.randint(0, len(tables[0])) if rng.random() < 0.2 else None
            if cut is not None:
                for table in tables:
                    del table[cut:]
            replaced = [(g, i, rng.randrange(0, 99)) for g in range(num_groups) for i in range(len(tables[g]))
                        if rng.random() < 0.1]
            for g, i, block in replaced:
                tables[g][i] = block
            added = blocks(max(0, -(-len(tokens) // BLOCK_SIZE) - len(tables[0])))
            for table, more in zip(tables, added):
                table.extend(more)
            diffs.append(ScheduledSequence(sid, 0, 1, new_token_ids=new, new_block_ids=added if added[0] else [],
                                           replaced_blocks=replaced, truncated_table_length=cut))
        batch.apply(diffs)  # one step: every sequence's tokens land in one vectorized write
        spans = [(sid, start, len(tokens) - start)
                 for sid, (tokens, _) in sorted(model.items()) for start in [rng.randrange(len(tokens))]]
        arrays = gather(batch, spans) if spans else None
        for sid, (tokens, tables) in model.items():
            assert [batch.block_ids(sid, g) for g in range(num_groups)] == tables
            assert batch.sequences[sid].output_token_ids == tokens[len(batch.sequences[sid].prompt_token_ids):]
        if arrays is None:
            continue
        for g in range(num_groups):
            expected = [expected_inputs(model[sid][0], model[sid][1][g], start, count) for sid, start, count in spans]
            assert arrays.input_ids.tolist() == [t for ids, _, _ in expected for t in ids]
            assert arrays.positions.tolist() == [p for _, positions, _ in expected for p in positions]
            assert arrays.slot_mappings[g].tolist() == [s for _, _, slots in expected for s in slots]
        rows = np.array([batch.sequences[sid].row for sid, _, _ in spans])
        for g in range(num_groups):
            assert batch.decode_tables(rows, 3, g).tolist() == [
                (model[sid][1][g] + [0, 0, 0])[:3] for sid, _, _ in spans]


def test_block_ids_must_name_every_group():
    """One group's list for a batch of two would be broadcast over both tables: refused."""
    batch = InputBatch(max_num_seqs=1, max_model_len=8, block_size=BLOCK_SIZE, num_groups=2)
    with pytest.raises(ValueError, match="1 groups for a batch of 2"):
        batch.add(new_sequence("s", [1, 2], [5]))
    assert not batch.sequences  # refused before anything changed
    batch.add(new_sequence("s", [1, 2], [[5], [6]]))
    with pytest.raises(ValueError, match="1 groups for a batch of 2"):
        batch.apply([ScheduledSequence("s", 2, 1, new_token_ids=[3, 4, 5], new_block_ids=[[7]])])
    assert batch.sequences["s"].output_token_ids == [] and batch.block_ids("s", 1) == [6]
