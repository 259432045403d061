"""The KV cache coordinator over per-group managers on a Gemma-like layout:
two sliding groups (window 8) beside a full-attention group, blocks of 4."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.block_moves import TierDrop, TierLoad, TierOffload
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import BlockRemoved, BlockStored, KVEventLog
from pagedllm.core.kv_groups import kv_group_layout
from pagedllm.core.kv_interface import NULL_BLOCK_ID, BlockCopy
from pagedllm.core.kv_managers.sliding_window import SlidingWindow
from pagedllm.core.request import Request
from pagedllm.core.tier_index import TierIndex, tier_key
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
WINDOW = 8
SLIDING = SlidingWindow(WINDOW)
LAYOUT = kv_group_layout([WINDOW if (layer + 1) % 3 else None for layer in range(6)])


def manager(num_blocks: int = 64, **options) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, windows=LAYOUT.windows, **options)


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(), [0], max_tokens=1)


def prefill(kv: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    """Admit ``tokens`` from the prefix cache, compute the rest, register the full blocks."""
    req = request(request_id, tokens)
    hits, num_cached, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(request_id, num_cached, len(tokens) - num_cached, hits) is not None
    kv.cache_full_blocks(req, len(tokens))
    return req


def test_the_layout_is_one_full_group_and_two_sliding_ones():
    assert LAYOUT.windows == (None, WINDOW, WINDOW)


def test_sliding_groups_release_behind_the_window_while_group_0_keeps_every_block():
    kv = manager()
    kv.allocate_slots("a", 0, 3)
    for position in range(3, 60):
        assert kv.allocate_slots("a", position, 1) == []
        assert kv.allocate_slots("a", position + 1, 0) == []  # the next token's window moved on
        released = SLIDING.num_released(position + 1, BLOCK_SIZE)
        assert kv.num_released("a") == [0, released, released]
        tables = kv.get_block_ids("a")
        assert None not in kv.groups[0].tables["a"].entries and len({len(table) for table in tables}) == 1
        assert all(table[:released] == [NULL_BLOCK_ID] * released for table in tables[1:])
        assert kv.num_blocks_in_use == LAYOUT.blocks_held(position + 1, BLOCK_SIZE)
        kv.check_invariants({"a": position + 1}, swapped=())
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants({}, swapped=())


def test_allocation_is_all_or_nothing_across_groups():
    kv = manager(num_blocks=5)
    assert kv.allocate_slots("a", 0, 4) is not None  # one block in each of 3 groups
    assert kv.allocate_slots("a", 4, 4) is None  # 3 more: only 2 free
    assert [len(table) for table in kv.get_block_ids("a")] == [1, 1, 1] and kv.num_free_blocks == 2
    kv.check_invariants({"a": 4}, swapped=())
    kv.free("a")


def test_a_prefix_longer_than_the_window_hits_and_takes_only_the_window_in_sliding_groups():
    kv = manager()
    prompt = list(range(100, 140))  # 10 full blocks
    prefill(kv, "a", prompt)
    kv.allocate_slots("a", 40, 0)  # the sliding groups release blocks 0-7: still cached
    kv.free("a")
    second = request("b", prompt + [1, 2])
    hits, num_cached, _ = kv.get_computed_blocks(second)
    assert num_cached == 40
    start = SLIDING.num_released(40, BLOCK_SIZE)
    assert start == 8 and all(block is not None for block in hits[0])
    assert all(entries[:start] == [None] * start and None not in entries[start:] for entries in hits[1:])
    assert {block.block_id for block in hits[1][start:]}.isdisjoint(block.block_id for block in hits[0])
    free_before = kv.num_free_blocks
    assert kv.allocate_slots("b", 40, 2, hits) == []
    assert kv.num_free_blocks == free_before - (10 + 2 + 2) - 3  # revived, plus one new block per group
    assert kv.num_released("b") == [0, 8, 8]
    kv.check_invariants({"b": 42}, swapped=())
    kv.free("b")


def _cached_prompt(kv: KVCacheManager) -> tuple[list[int], Request]:
    prompt = list(range(200, 240))
    prefill(kv, "a", prompt)
    kv.free("a")
    probe = request("probe", prompt + [1])
    extend_block_hashes(probe.block_hashes, probe.all_token_ids, BLOCK_SIZE, probe.extra_keys)
    return prompt, probe


def test_a_sliding_group_missing_a_window_block_lowers_the_hit():
    kv = manager()
    _, probe = _cached_prompt(kv)
    assert kv.get_computed_blocks(probe).num_tokens == 40
    # Behind the window of the hit point: the hit stays.
    kv.block_pool._evict(kv.block_pool.get_cached_block(probe.block_hashes[2], 1))
    assert kv.get_computed_blocks(probe).num_tokens == 40
    # Inside it (block 9, group 2): the hit drops to block 9, whose window (blocks 7, 8) is whole.
    kv.block_pool._evict(kv.block_pool.get_cached_block(probe.block_hashes[9], 2))
    hit = kv.get_computed_blocks(probe)
    assert hit.num_tokens == 36 and hit.blocks[1][:7] == [None] * 7 and len(hit.blocks[0]) == 9
    # Group 1 loses block 8 too: the hit point 9 needs 7-8, the hit point 8 needs 6-7 (all there).
    kv.block_pool._evict(kv.block_pool.get_cached_block(probe.block_hashes[8], 1))
    assert kv.get_computed_blocks(probe).num_tokens == 32


def test_the_full_group_bounds_the_hit():
    kv = manager()
    _, probe = _cached_prompt(kv)
    kv.block_pool._evict(kv.block_pool.get_cached_block(probe.block_hashes[5], 0))
    hit = kv.get_computed_blocks(probe)
    assert hit.num_tokens == 20 and [len(entries) for entries in hit.blocks] == [5, 5, 5]


def test_a_groups_fresh_blocks_never_evict_another_groups_hit():
    """Every group revives its hit before any takes a fresh block: here group 0's
    three fresh blocks would otherwise evict group 1's hit (block 2), next in line."""
    kv = manager(num_blocks=12)
    prefill(kv, "a", list(range(8)))  # blocks 0-1, 2-3, 4-5 in groups 0, 1, 2
    prefill(kv, "d", list(range(50, 58)))  # blocks 6-11
    kv.free("a")
    kv.free("d")  # every block cached and free, a's first in line
    second = request("b", [0, 1, 2, 3] + [9] * 9)
    hits, num_cached, _ = kv.get_computed_blocks(second)
    assert num_cached == 4 and [[block.block_id for block in group] for group in hits] == [[0], [2], [4]]
    assert kv.allocate_slots("b", 4, 9, hits) == []
    assert [table[0] for table in kv.get_block_ids("b")] == [0, 2, 4]
    kv.check_invariants({"b": 13}, swapped=())
    kv.free("b")


def test_the_same_tokens_are_cached_apart_in_each_group():
    kv = manager()
    prefill(kv, "a", list(range(8)))
    keys = sorted(kv.block_pool.cached_blocks)
    assert [group for group, _ in keys] == [0, 0, 1, 1, 2, 2]
    assert len({block_hash for _, block_hash in keys}) == 2
    kv.free("a")


def test_fork_and_copy_on_write_per_group():
    kv = manager()
    kv.allocate_slots("p", 0, 6)  # one full block and a shared tail in each group
    assert kv.fork("p", "c") == []
    parent = kv.get_block_ids("p")
    copies = kv.allocate_slots("c", 6, 1)
    assert [(copy.src, copy.table_index, copy.group) for copy in copies] == [(parent[g][1], 1, g) for g in range(3)]
    child = kv.get_block_ids("c")
    assert kv.get_block_ids("p") == parent
    assert [table[0] for table in child] == [table[0] for table in parent]  # full blocks stay shared
    assert [table[1] for table in child] == [copy.dst for copy in copies]
    kv.check_invariants({"p": 6, "c": 7}, swapped=())
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == kv.num_blocks


def test_fork_without_sharing_copies_every_held_block_of_every_group():
    kv = manager(enable_block_sharing=False)
    kv.allocate_slots("p", 0, 20)
    kv.allocate_slots("p", 20, 0)  # sliding groups release blocks 0-2
    copies = kv.fork("p", "c")
    assert sorted({copy.group for copy in copies}) == [0, 1, 2] and len(copies) == 5 + 2 + 2
    assert all(isinstance(copy, BlockCopy) and copy.table_index >= (3 if copy.group else 0) for copy in copies)
    assert kv.num_released("c") == [0, 3, 3]
    kv.check_invariants({"p": 20, "c": 20}, swapped=())
    kv.free("p")
    kv.free("c")


def test_swap_out_and_in_per_group_keeps_released_entries():
    kv = manager(num_swap_blocks=32)
    kv.allocate_slots("a", 0, 30)
    kv.allocate_slots("a", 30, 0)
    held = kv.num_blocks_in_use
    before = kv.get_block_ids("a")
    out = kv.swap_out("a")
    assert len(out) == held and kv.num_free_blocks == kv.num_blocks
    assert kv.num_released("a") == [0, 5, 5]
    kv.check_invariants({}, swapped={"a"})
    assert kv.swap_in_cost("a", 30, 1) == held  # token 30 fits block 7, which every table has
    back = kv.swap_in("a")
    assert sorted(host for host, _ in back) == sorted(host for _, host in out)
    after = kv.get_block_ids("a")
    assert [table[:5] for table in after[1:]] == [[NULL_BLOCK_ID] * 5] * 2 == [table[:5] for table in before[1:]]
    kv.check_invariants({"a": 30}, swapped=())
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks and kv.swap_space.num_free_blocks == 32


def test_truncate_cuts_every_group():
    kv = manager()
    kv.allocate_slots("a", 0, 5)
    kv.allocate_slots("a", 5, 6)  # drafts to position 10: 3 blocks
    assert kv.truncate("a", 5) == 2
    assert [len(table) for table in kv.get_block_ids("a")] == [2, 2, 2]
    kv.check_invariants({"a": 5}, swapped=())
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks


def test_events_announce_only_group_0():
    events = KVEventLog()
    kv = manager(num_blocks=6, events=events)
    prefill(kv, "a", list(range(8)))
    stored = [event for event in events.take() if isinstance(event, BlockStored)]
    assert len(stored) == 2
    kv.free("a")
    assert kv.allocate_slots("b", 0, 8) == []  # takes every block: evicts all six cached ones
    removed = [h for event in events.take() if isinstance(event, BlockRemoved) for h in event.block_hashes]
    assert sorted(removed) == sorted(h for event in stored for h in event.block_hashes)
    kv.free("b")


def test_pool_snapshot_names_each_blocks_group():
    kv = manager(num_blocks=8)
    prefill(kv, "a", list(range(6)))
    snapshot = kv.pool_snapshot()
    used = [block["group"] for block in snapshot if block["state"] == "used"]
    assert sorted(used) == [0, 0, 1, 1, 2, 2]
    kv.free("a")
    groups = {block["group"] for block in kv.pool_snapshot() if block["state"] == "cached"}
    assert groups == {0, 1, 2}
    assert all(block["group"] is None for block in kv.pool_snapshot() if block["state"] == "free")


def test_tier_hits_count_per_group_and_load_each_groups_blocks():
    """A prefix evicted to the host tier comes back per group: group 0 all of it, a
    sliding group only the blocks inside the window of the hit point, each under its
    own (group, hash) key, loaded into fresh blocks of that group's table."""
    tiers = TierIndex(host_capacity_blocks=64, block_size=BLOCK_SIZE)
    kv = manager(num_blocks=33, tiers=tiers)
    prompt = list(range(100, 140))  # 10 full blocks, cached in each of the 3 groups
    kv.free(prefill(kv, "a", prompt).request_id)
    kv.free(prefill(kv, "b", list(range(500, 544))).request_id)  # 33 blocks: every one of "a"'s is evicted
    assert tiers.num_host_blocks == 30 and kv.take_tier_moves().of(TierOffload)
    hashes = extend_block_hashes([], prompt, BLOCK_SIZE)
    hit = kv.get_computed_blocks(request("c", prompt + [1]))
    window_start = SLIDING.num_released(40, BLOCK_SIZE)
    assert hit.num_tokens == 40 and not hit.loading
    assert hit.blocks[0] == hashes and hit.blocks[1] == hit.blocks[2] == [None] * window_start + hashes[window_start:]
    assert kv.allocate_slots("c", 40, 1, hit.blocks) == []
    loads = dict(kv.take_tier_moves().of(TierLoad))
    tables = kv.get_block_ids("c")
    expected = {tier_key(group, hashes[index]): tables[group][index]
                for group in range(3) for index in range(window_start if group else 0, 10)}
    assert loads == expected and len(set(loads)) == 10 + 2 * (10 - window_start)
    assert tables[1][:window_start] == [NULL_BLOCK_ID] * window_start
    kv.check_invariants({"c": 41}, swapped=())
    kv.free("c")
    assert kv.num_free_blocks == kv.num_blocks


def test_a_sliding_groups_hit_mixes_pool_blocks_and_tier_loads():
    """Evictions take group 0's blocks, then group 1's last one: group 0 loads all of
    its hit, group 1 keeps its pool block and loads the next, group 2 loads nothing."""
    tiers = TierIndex(host_capacity_blocks=64, block_size=BLOCK_SIZE)
    kv = manager(num_blocks=33, tiers=tiers)
    prompt = list(range(100, 140))
    kv.free(prefill(kv, "a", prompt).request_id)  # free queue: 3 unused, then each group's blocks, tail first
    kv.block_pool.free_blocks(kv.block_pool.get_new_blocks(3 + 10 + 1))
    hashes = extend_block_hashes([], prompt, BLOCK_SIZE)
    hit = kv.get_computed_blocks(request("c", prompt + [1]))
    assert hit.num_tokens == 40 and hit.blocks[0] == hashes
    (kept_1, loaded_1), pooled_2 = hit.blocks[1][8:], hit.blocks[2][8:]
    assert isinstance(kept_1, KVCacheBlock) and loaded_1 == hashes[9]
    assert all(isinstance(block, KVCacheBlock) for block in pooled_2)
    assert kv.allocate_slots("c", 40, 1, hit.blocks) == []
    kv.take_tier_moves()  # the evictions' offloads and the loads
    tables = kv.get_block_ids("c")
    assert tables[1][8] == kept_1.block_id and tables[2][8:10] == [block.block_id for block in pooled_2]
    assert tiers.counters.host_hits == 11
    kv.check_invariants({"c": 41}, swapped=())
    kv.free("c")
    assert kv.num_free_blocks == kv.num_blocks


class CoordinatorMachine(RuleBasedStateMachine):
    """Requests are admitted with prefix hits, grow, fork, swap out and back,
    speculate and roll back, and end in a small pool (evictions). The pool's
    contents are simulated: every written slot holds (group, token), so a group
    reading another's K/V, a stale block or a missed copy shows up."""

    NUM_BLOCKS = 24  # small: admissions evict cached blocks, other groups' hits among them
    KINDS = LAYOUT.kinds  # each group's attention kind (test_kv_chunked.py runs chunked groups)
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.kv = self._manager(num_swap_blocks=self.NUM_BLOCKS)
        self.pool: list[list] = [[None] * BLOCK_SIZE for _ in range(self.NUM_BLOCKS)]
        self.host: list[list] = [[None] * BLOCK_SIZE for _ in range(self.NUM_BLOCKS)]
        self.requests: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.ids = itertools.count()
        self.prompts: list[list[int]] = []  # every prompt admitted, for prompts that repeat one

    def _manager(self, **options) -> KVCacheManager:
        return KVCacheManager(self.NUM_BLOCKS, BLOCK_SIZE, windows=self.KINDS, **options)

    def _write(self, seq: str, start: int, labels: list) -> None:
        tables = self.kv.get_block_ids(seq)
        for group, table in enumerate(tables):
            for position, label in enumerate(labels, start):
                block = table[position // BLOCK_SIZE]
                assert self.kv.block_pool.blocks[block].ref_cnt == 1
                self.pool[block][position % BLOCK_SIZE] = (group, label)

    def _copy(self, copies) -> None:
        for copy in copies:
            self.pool[copy.dst] = list(self.pool[copy.src])

    @rule(target=sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=30))
    def admit(self, tokens):
        seq = f"s{next(self.ids)}"
        self.prompts.append(tokens)
        req = request(seq, tokens)
        hits, num_cached, _ = self.kv.get_computed_blocks(req)
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(tokens)
        copies = self.kv.allocate_slots(seq, num_cached, len(tokens) - num_cached, hits)
        if copies is None:
            return multiple()
        assert copies == []
        self._copy(copies)
        req.num_computed_tokens = num_cached
        self._write(seq, num_cached, tokens[num_cached:])
        self.kv.cache_full_blocks(req, len(tokens))
        self.requests[seq] = req
        return seq

    @rule(seq=sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def grow(self, seq, tokens):
        req = self.requests.get(seq)
        if req is None or seq in self.swapped:
            return
        copies = self.kv.allocate_slots(seq, req.num_tokens, len(tokens))
        if copies is None:
            return
        self._copy(copies)
        start = req.num_tokens
        req.all_token_ids.extend(tokens)
        req.output_token_ids.extend(tokens)
        self._write(seq, start, tokens)
        self.kv.cache_full_blocks(req, req.num_tokens)

    @rule(target=sequences, parent=sequences)
    def fork(self, parent):
        req = self.requests.get(parent)
        if req is None or parent in self.swapped:
            return multiple()
        child = f"s{next(self.ids)}"
        assert self.kv.fork(parent, child) == []
        self.requests[child] = req.fork(child, 1, 0)
        self.requests[child].all_token_ids[:] = req.all_token_ids
        assert self.kv.get_block_ids(child) == self.kv.get_block_ids(parent)
        return child

    @rule(seq=sequences)
    def swap_out(self, seq):
        if seq not in self.requests or seq in self.swapped:
            return
        moves = self.kv.swap_out(seq)
        if moves is not None:
            for device, host in moves:
                self.host[host] = list(self.pool[device])
            self.swapped.add(seq)

    @rule(seq=sequences)
    def swap_in(self, seq):
        if seq not in self.swapped:
            return
        req = self.requests[seq]
        if not self.kv.tails.hold(seq):  # (as ``admit_swapped`` does)
            return
        if self.kv.swap_in_cost(seq, req.num_tokens, 1) > self.kv.num_free_blocks:
            self.kv.tails.release(seq)
            return
        moves = self.kv.swap_in(seq)
        self._copy([])  # (the tiered machine's offloads: a swap-in may evict)
        for host, device in moves:
            self.pool[device] = list(self.host[host])
        self.swapped.discard(seq)
        copies = self.kv.allocate_slots(seq, req.num_tokens, 1)
        assert copies is not None  # counted by swap_in_cost
        self._copy(copies)
        self.kv.truncate(seq, req.num_tokens)

    @rule(seq=sequences, num_drafts=st.integers(1, 6))
    def speculate_and_reject(self, seq, num_drafts):
        req = self.requests.get(seq)
        if req is None or seq in self.swapped:
            return
        copies = self.kv.allocate_slots(seq, req.num_tokens, num_drafts)
        if copies is None:
            return
        self._copy(copies)
        self._write(seq, req.num_tokens, ["draft"] * num_drafts)
        assert self.kv.truncate(seq, req.num_tokens) == -(-req.num_tokens // BLOCK_SIZE)

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if self.requests.pop(seq, None) is not None:
            self.swapped.discard(seq)
            self.kv.free(seq)

    @invariant()
    def invariants_hold_and_each_group_reads_its_own_tokens(self):
        running = {seq: req.num_tokens for seq, req in self.requests.items() if seq not in self.swapped}
        self.kv.check_invariants(running, self.swapped)
        for seq, num_tokens in running.items():
            tokens = self.requests[seq].all_token_ids
            tables = self.kv.get_block_ids(seq)
            assert len({len(table) for table in tables}) == 1
            for group, (table, kind) in enumerate(zip(tables, self.KINDS)):
                first = kind.first_position_read(num_tokens)  # what the next query reads
                read = [self.pool[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(first, num_tokens)]
                assert read == [(group, token) for token in tokens[first:num_tokens]]

    def teardown(self):
        for seq in list(self.requests):
            self.kv.free(seq)
        assert self.kv.num_free_blocks == self.NUM_BLOCKS
        assert self.kv.swap_space.num_free_blocks == self.NUM_BLOCKS
        self.kv.check_invariants({}, swapped=())


TestCoordinator = CoordinatorMachine.TestCase
TestCoordinator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class TailCoordinatorMachine(CoordinatorMachine):
    """The same operations on an int8 pool: each request holds a full-precision tail
    per group, a run of two aligned blocks of the same pool, while it writes (a fork's
    child from its first growth on); the checker verifies every run and its owner,
    and the teardown that every block, tails' included, is free again."""

    def _manager(self, **options) -> KVCacheManager:
        return super()._manager(tail_run_blocks=2, tails_per_request=len(self.KINDS), **options)

    @invariant()
    def tails_are_held_by_the_requests_that_write(self):
        holders = set(self.kv.tails.held)
        assert holders <= set(self.requests) - self.swapped
        held = sum(len(runs) for runs in self.kv.tails.held.values()) * 2
        assert held == sum(block.ref_cnt > 0 and block.owner is not None for block in self.kv.block_pool.blocks)


TestTailCoordinator = TailCoordinatorMachine.TestCase
TestTailCoordinator.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


class TieredCoordinatorMachine(CoordinatorMachine):
    """The same operations over a host tier that keeps what the pool evicts: each group's
    blocks go down and come back under their own key (``tier_key``) and still read their
    group's tokens. The tier's moves are carried out in the runner's order around the copies."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = self._manager(num_swap_blocks=self.NUM_BLOCKS,
                                tiers=TierIndex(host_capacity_blocks=24, block_size=BLOCK_SIZE))
        self.tier_store: dict[bytes, list] = {}

    @rule(target=CoordinatorMachine.sequences, index=st.integers(0, 40), extra=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def readmit(self, index, extra):
        """A prompt admitted before, extended: its prefix is often below the pool by now."""
        if not self.prompts:
            return multiple()
        return self.admit(self.prompts[index % len(self.prompts)] + extra)

    def _copy(self, copies) -> None:
        moves = self.kv.take_tier_moves()
        for block, key in moves.of(TierOffload):
            self.tier_store[key] = list(self.pool[block])
        super()._copy(copies)
        for key, block in moves.of(TierLoad):
            self.pool[block] = list(self.tier_store[key])
        for (key,) in moves.of(TierDrop):
            del self.tier_store[key]


TestTieredCoordinator = TieredCoordinatorMachine.TestCase
TestTieredCoordinator.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
