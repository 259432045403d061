"""Fork, reference counts and copy-on-write, checked against a reference model.

The state machine keeps a shadow of the KV pool (one label per token slot) and
of each sequence's expected tokens. Every write goes through the manager's
block table after performing the copies it asked for, so if copy-on-write ever
let one sequence write into a block another still reads, the read-back check
catches it.
"""

from __future__ import annotations

import itertools
import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from pagedllm.core.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4
NUM_BLOCKS = 24


class BlockSharingMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.pool = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]  # shadow KV data
        self.expected: dict[str, list[int]] = {}
        self.ids = itertools.count()
        self.labels = itertools.count()

    def _write(self, seq: str, num_new: int) -> bool:
        tokens = self.expected[seq]
        copies = self.kv.allocate_slots(seq, len(tokens), num_new)
        if copies is None:
            return False
        # A write into a shared block is one copy, never more.
        assert len(copies) <= 1
        for src, dst, table_index, _ in copies:
            self.pool[dst] = list(self.pool[src])
            assert table_index == len(tokens) // BLOCK_SIZE  # only the entry being written is replaced
        table = self.kv.get_block_ids(seq)[0]
        for position in range(len(tokens), len(tokens) + num_new):
            label = next(self.labels)
            block = table[position // BLOCK_SIZE]
            # Only blocks this sequence owns alone are ever written.
            assert self.kv.block_pool.blocks[block].ref_cnt == 1
            self.pool[block][position % BLOCK_SIZE] = label
            tokens.append(label)
        return True

    @rule(target=sequences, num_tokens=st.integers(1, 12))
    def new_sequence(self, num_tokens):
        seq = f"s{next(self.ids)}"
        self.expected[seq] = []
        if not self._write(seq, num_tokens):
            del self.expected[seq]
            assert seq not in self.kv.groups[0].tables
            return multiple()
        return seq

    @rule(seq=sequences, num_tokens=st.integers(1, 6))
    def append(self, seq, num_tokens):
        if seq in self.expected:
            before = list(self.kv.get_block_ids(seq)[0])
            if not self._write(seq, num_tokens):
                assert self.kv.get_block_ids(seq)[0] == before  # all-or-nothing

    @rule(target=sequences, parent=sequences)
    def fork(self, parent):
        if parent not in self.expected:
            return multiple()
        child = f"s{next(self.ids)}"
        counts = [self.kv.block_pool.blocks[b].ref_cnt for b in self.kv.get_block_ids(parent)[0]]
        assert self.kv.fork(parent, child) == []
        self.expected[child] = list(self.expected[parent])
        assert self.kv.get_block_ids(child)[0] == self.kv.get_block_ids(parent)[0]
        assert [self.kv.block_pool.blocks[b].ref_cnt for b in self.kv.get_block_ids(child)[0]] == [c + 1 for c in counts]
        return child

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.expected:
            del self.expected[seq]
            self.kv.free(seq)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq, tokens in self.expected.items():
            table = self.kv.get_block_ids(seq)[0]
            assert len(table) == math.ceil(len(tokens) / BLOCK_SIZE)
            read = [self.pool[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(tokens))]
            assert read == tokens

    @invariant()
    def counts_match_tables_and_no_block_is_both_free_and_used(self):
        self.kv.check_invariants({seq: len(tokens) for seq, tokens in self.expected.items()}, swapped=())
        used = {b for seq in self.expected for b in self.kv.get_block_ids(seq)[0]}
        assert len(used) + self.kv.num_free_blocks == NUM_BLOCKS

    def teardown(self):
        for seq in list(self.expected):
            self.kv.free(seq)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        self.kv.check_invariants({}, swapped=())


TestBlockSharing = BlockSharingMachine.TestCase
TestBlockSharing.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_copy_on_write_copies_exactly_one_block_on_divergence():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("parent", 0, 6)  # blocks: [full, 2 of 4 used]
    kv.fork("parent", "child")
    shared_tail = kv.get_block_ids("parent")[0][1]
    assert kv.block_pool.blocks[shared_tail].ref_cnt == 2
    copies = kv.allocate_slots("child", 6, 1)
    assert len(copies) == 1 and copies[0].src == shared_tail and copies[0].table_index == 1
    assert kv.get_block_ids("child")[0][0] == kv.get_block_ids("parent")[0][0]  # the full block stays shared
    assert kv.get_block_ids("child")[0][1] == copies[0][1] != shared_tail
    assert kv.block_pool.blocks[shared_tail].ref_cnt == 1
    assert kv.allocate_slots("parent", 6, 1) == []  # the parent now owns its tail alone


def test_fork_without_sharing_copies_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_block_sharing=False)
    kv.allocate_slots("parent", 0, 6)
    copies = kv.fork("parent", "child")
    assert [copy.src for copy in copies] == kv.get_block_ids("parent")[0]
    assert [copy.dst for copy in copies] == kv.get_block_ids("child")[0]
    assert [copy.table_index for copy in copies] == list(range(len(copies)))
    assert kv.num_free_blocks == 4
