"""Blocks that fall out of a sliding window are released exactly then, on every path.

A shadow of the pool (one label per token slot) checks that every sequence
still reads its own tokens across its last query's window, that the entries
before the window are released (NULL in the runner's view, owned by no
table), that forks, swaps and frees keep the ref counts right, and that the
pool is all free at the end.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_interface import NULL_BLOCK_ID
from pagedllm.core.kv_managers.full_attention import FullAttention
from pagedllm.core.kv_managers.sliding_window import SlidingWindow
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

NUM_BLOCKS = 24


@given(st.integers(0, 200), st.integers(1, 40), st.sampled_from([1, 2, 4, 8, 16]))
def test_out_of_window_blocks_are_those_no_later_query_sees(next_position, window, block_size):
    # Block i is out when no query at position >= next_position sees any of its positions.
    out = [
        all(key <= query - window for key in range(i * block_size, (i + 1) * block_size)
            for query in range(next_position, next_position + window + block_size))
        for i in range(next_position // block_size + 1)
    ]
    expected = out.index(False) if False in out else len(out)
    assert SlidingWindow(window).num_released(next_position, block_size) == expected
    assert FullAttention().num_released(next_position, block_size) == 0


class SlidingWindowMachine(RuleBasedStateMachine):
    """Sequences grow, fork, swap out and back, and end, under a window of ``WINDOW`` tokens."""

    WINDOW = 6
    BLOCK_SIZE = 4
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, self.BLOCK_SIZE, num_swap_blocks=NUM_BLOCKS,
                                 windows=(self.WINDOW,))
        self.pool = [[None] * self.BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.host = [[None] * self.BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.expected: dict[str, list[int]] = {}
        # Tokens computed when the sequence last allocated: what its window was released for.
        self.allocated_at: dict[str, int] = {}
        self.ids = itertools.count()
        self.labels = itertools.count()

    def _write(self, seq: str, num_new: int) -> bool:
        tokens = self.expected[seq]
        copies = self.kv.allocate_slots(seq, len(tokens), num_new)
        self.allocated_at[seq] = len(tokens)
        if copies is None:
            return False
        for src, dst, *_ in copies:
            self.pool[dst] = list(self.pool[src])
        table = self.kv.get_block_ids(seq)[0]
        for position in range(len(tokens), len(tokens) + num_new):
            block = table[position // self.BLOCK_SIZE]
            assert self.kv.block_pool.blocks[block].ref_cnt == 1
            label = next(self.labels)
            self.pool[block][position % self.BLOCK_SIZE] = label
            tokens.append(label)
        return True

    @rule(target=sequences, num_tokens=st.integers(1, 14))
    def new_sequence(self, num_tokens):
        seq = f"s{next(self.ids)}"
        self.expected[seq] = []
        if not self._write(seq, num_tokens):
            del self.expected[seq]
            return multiple()
        return seq

    @rule(seq=sequences, num_tokens=st.integers(1, 6))
    def append(self, seq, num_tokens):
        if seq in self.expected:
            self._write(seq, num_tokens)

    @rule(target=sequences, parent=sequences)
    def fork(self, parent):
        if parent not in self.expected:
            return multiple()
        child = f"s{next(self.ids)}"
        assert self.kv.fork(parent, child) == []
        self.expected[child] = list(self.expected[parent])
        self.allocated_at[child] = self.allocated_at[parent]
        assert self.kv.get_block_ids(child)[0] == self.kv.get_block_ids(parent)[0]
        return child

    @rule(seq=sequences)
    def swap_out_and_in(self, seq):
        if seq not in self.expected:
            return
        for device, host in self.kv.swap_out(seq):
            self.host[host] = list(self.pool[device])
        for host, device in self.kv.swap_in(seq):
            self.pool[device] = list(self.host[host])

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.expected:
            del self.expected[seq]
            self.kv.free(seq)

    @invariant()
    def released_exactly_out_of_window_and_the_window_reads_back(self):
        for seq, tokens in self.expected.items():
            table = self.kv.get_block_ids(seq)[0]
            released = SlidingWindow(self.WINDOW).num_released(self.allocated_at[seq], self.BLOCK_SIZE)
            assert self.kv.num_released(seq) == [released]
            assert all(entry is None for entry in self.kv.groups[0].tables[seq].entries[:released])
            assert table[:released] == [NULL_BLOCK_ID] * released
            # The next query (position len) sees keys from len - WINDOW + 1 on.
            window = range(max(0, len(tokens) - self.WINDOW + 1), len(tokens))
            read = [self.pool[table[p // self.BLOCK_SIZE]][p % self.BLOCK_SIZE] for p in window]
            assert read == tokens[window.start:]

    @invariant()
    def only_held_entries_own_blocks(self):
        self.kv.check_invariants({seq: len(tokens) for seq, tokens in self.expected.items()}, swapped=())
        held = {block.block_id for record in self.kv.groups[0].tables.values() for block in record.entries if block is not None}
        assert len(held) + self.kv.num_free_blocks == NUM_BLOCKS

    def teardown(self):
        for seq in list(self.expected):
            self.kv.free(seq)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        self.kv.check_invariants({}, swapped=())


class DividingWindowMachine(SlidingWindowMachine):
    WINDOW = 8  # a multiple of the block size


TestSlidingWindow = SlidingWindowMachine.TestCase
TestSlidingWindow.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestDividingWindow = DividingWindowMachine.TestCase
TestDividingWindow.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_a_long_sequence_holds_only_its_window():
    kv = KVCacheManager(num_blocks=8, block_size=4, windows=(16,))
    kv.allocate_slots("a", 0, 3)
    for position in range(3, 400):  # 100 blocks' worth of tokens through an 8-block pool
        assert kv.allocate_slots("a", position, 1) == []
        assert kv.num_blocks_in_use <= 16 // 4 + 1
    assert kv.peak_blocks_in_use == 5
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_released_blocks_stay_cached_and_a_hit_takes_only_its_window():
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(6,))
    prompt = list(range(100, 124))  # 6 full blocks
    first = Request("a", prompt, SamplingParams(), [0], max_tokens=1)
    kv.allocate_slots("a", 0, 20)
    kv.cache_full_blocks(first, 20)
    kv.allocate_slots("a", 20, 4)  # releases blocks 0-2 (positions <= 14): still cached, refcount 0
    kv.cache_full_blocks(first, 24)
    assert kv.num_released("a") == [3] and kv.num_cached_blocks == 6
    kv.free("a")
    second = Request("b", prompt + [7, 8], SamplingParams(), [0], max_tokens=1)
    hits, num_cached, _ = kv.get_computed_blocks(second)
    assert num_cached == 24
    free_before = kv.num_free_blocks
    kv.allocate_slots("b", num_cached, 2, hits)
    # Position 24 sees 19..24: blocks 0-3 are out of window, so they were never revived.
    assert kv.num_released("b") == [4] and kv.get_block_ids("b")[0][:4] == [NULL_BLOCK_ID] * 4
    assert kv.num_free_blocks == free_before - 3  # blocks 4, 5 revived, one new for 24-25
    kv.free("b")
    # A prefix that outgrew the window still hits without the blocks behind its window...
    kv.block_pool._evict(kv.block_pool.blocks[2])
    assert kv.get_computed_blocks(second).num_tokens == 24
    # ...but losing a block the hit point's window reads lowers the hit to where a window is whole.
    kv.block_pool._evict(hits[0][4])
    hits, num_cached, _ = kv.get_computed_blocks(second)
    assert num_cached == 8 and hits[0][0] is not None


def test_a_swapped_table_keeps_its_released_entries_and_registers_again():
    """A request's table record moves to the swapped tables and back: the
    released count with it, the registered count dropped (the blocks come back
    as fresh copies, registered again by the next ``cache_full_blocks``)."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_swap_blocks=8, windows=(6,))
    request = Request("a", list(range(100, 124)), SamplingParams(), [0], max_tokens=1)
    kv.allocate_slots("a", 0, 20)
    kv.allocate_slots("a", 20, 4)  # releases entries 0-2
    kv.cache_full_blocks(request, 24)
    assert (kv.groups[0].tables["a"].num_released, kv.groups[0].tables["a"].num_registered) == (3, 6)
    assert len(kv.swap_out("a")) == 3
    assert "a" not in kv.groups[0].tables and kv.num_released("a") == [3]
    kv.check_invariants({}, swapped={"a"})
    assert len(kv.swap_in("a")) == 3
    record = kv.groups[0].tables["a"]
    assert (record.num_released, record.num_registered) == (3, 0)
    assert kv.get_block_ids("a")[0][:3] == [NULL_BLOCK_ID] * 3
    kv.cache_full_blocks(request, 24)  # the swapped-out originals are still cached: they stay the cached ones
    assert record.num_registered == 6
    kv.check_invariants({"a": 24}, swapped=())
    kv.free("a")
    kv.check_invariants({}, swapped=())
    assert kv.num_free_blocks == 16
