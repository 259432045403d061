"""The tier index's bookkeeping alone: which moves it owes the runner, and when.

The disk here is a ``DiskCatalog`` held in a dict (the protocol is all the
index sees); the real disk tier is tested through the engine in test_tiers.py.
"""

from __future__ import annotations

import pytest

from pagedllm.core.block_moves import BlockMovePlan, TierDrop, TierLoad, TierOffload, TierPersist
from pagedllm.core.kv_events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored, KVEventLog
from pagedllm.core.tier_index import TierIndex, tier_key


def drops(moves: BlockMovePlan) -> list:
    """The keys a plan drops from the host tier."""
    return [move.key for move in moves.of(TierDrop)]


class DictDisk:
    """A disk catalog whose files are dict entries; fetches land when ``complete`` is called."""

    enabled = True

    def __init__(self, files: set[bytes], bad: set[bytes] = frozenset()) -> None:
        self.files, self.bad = set(files), set(bad)
        self.requested: list[bytes] = []
        self.reports: list[tuple[bytes, str]] = []

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.files

    def fetch(self, block_hashes: list[bytes]) -> None:
        self.requested += block_hashes

    def complete(self) -> None:
        self.reports += [(h, "bad" if h in self.bad else "landed") for h in self.requested]
        self.requested = []

    def take_fetched(self) -> list[tuple[bytes, str]]:
        reports, self.reports = self.reports, []
        return reports

    def take_removed(self) -> list[bytes]:
        return []


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_offloads_fill_the_host_lru_and_evict_the_oldest():
    events = KVEventLog()
    index = TierIndex(host_capacity_blocks=2, events=events)
    for block_id in range(3):
        index.offload(block_id, h(block_id), None, [block_id] * 16)
    moves = index.take_moves()
    assert moves.of(TierOffload) == [(0, h(0)), (1, h(1)), (2, h(2))]
    assert drops(moves) == [h(0)]  # the runner drops after it offloads, so the copy made was short-lived
    assert index.host_hashes == [h(1), h(2)]
    assert [type(e) for e in events.take()] == [BlockStored, BlockStored, BlockStored, BlockRemoved]
    index.check_invariants()


def test_a_lookup_finds_the_leading_host_blocks_and_a_load_keeps_them():
    index = TierIndex(host_capacity_blocks=4)
    for block_id in range(3):
        index.offload(block_id, h(block_id), None, None)
    index.take_moves()
    assert index.lookup([h(0), h(1), h(9), h(2)]) == (2, False)  # stops at the first miss
    index.load(h(0), 7)
    moves = index.take_moves()
    assert moves.of(TierLoad) == [(h(0), 7)] and not drops(moves)
    assert index.counters.host_hits == 1
    assert index.host_hashes[-1] == h(0)  # most recently used


def test_a_lookup_pins_its_hits_against_the_evictions_of_the_same_schedule():
    index = TierIndex(host_capacity_blocks=2)
    index.offload(0, h(0), None, None)
    index.offload(1, h(1), None, None)
    index.take_moves()
    assert index.lookup([h(0), h(1)]) == (2, False)
    index.offload(2, h(2), None, None)  # admitting the request evicts a pool block
    assert set(index.host_hashes) >= {h(0), h(1)}  # over capacity rather than dropping a pinned hit
    index.load(h(0), 5)
    index.load(h(1), 6)
    moves = index.take_moves()
    assert moves.of(TierLoad) == [(h(0), 5), (h(1), 6)]
    index.check_invariants()


def test_an_entry_dropped_this_step_is_not_offloaded_again_in_it():
    index = TierIndex(host_capacity_blocks=1)
    index.offload(0, h(0), None, None)
    index.offload(1, h(1), None, None)  # drops h(0)
    index.offload(2, h(0), None, None)  # h(0) evicted from the pool again in the same step
    moves = index.take_moves()
    assert moves.of(TierOffload) == [(0, h(0)), (1, h(1))] and drops(moves) == [h(0)]


def test_disk_hits_are_fetched_and_the_request_waits_until_they_land():
    disk = DictDisk({h(1), h(2)})
    index = TierIndex(host_capacity_blocks=0, disk=disk)
    assert index.lookup([h(1), h(2), h(3)]) == (0, True)
    assert disk.requested == [h(1), h(2)] and index.fetching
    assert index.lookup([h(1), h(2), h(3)]) == (0, True)  # still in flight: not asked twice
    assert disk.requested == [h(1), h(2)]
    disk.complete()
    assert index.lookup([h(1), h(2), h(3)]) == (2, False)
    index.load(h(1), 0)
    index.load(h(2), 1)
    moves = index.take_moves()
    # Disk only: host memory keeps nothing once the loads are done.
    assert moves.of(TierLoad) == [(h(1), 0), (h(2), 1)] and drops(moves) == [h(1), h(2)]
    assert index.counters.disk_hits == 2 and index.counters.fetches == 2


def test_a_bad_file_is_a_miss_and_is_not_fetched_again():
    disk = DictDisk({h(1), h(2)}, bad={h(1)})
    index = TierIndex(host_capacity_blocks=4, disk=disk)
    assert index.lookup([h(1), h(2)]) == (0, True)
    disk.complete()
    assert index.wait_landed()
    assert index.lookup([h(1), h(2)]) == (0, False)  # h(1) is a miss: the prefix stops there
    assert disk.requested == []
    assert index.counters.fetch_failures == 1


def test_landed_fetches_stay_pinned_until_loaded_or_expired():
    """Pins count seconds, not schedules: an idle engine waiting for a long fetch runs
    many empty schedules, and its first landed blocks must still be there at the end."""
    now = [0.0]
    disk = DictDisk({h(1), h(2)})
    index = TierIndex(host_capacity_blocks=0, disk=disk, fetch_pin_s=30.0, clock=lambda: now[0])
    assert index.lookup([h(1), h(2)]) == (0, True)
    disk.reports.append((h(1), "landed"))  # the first block lands; the second is still being read
    assert index.lookup([h(1), h(2)]) == (1, True)
    for _ in range(1000):
        assert not drops(index.take_moves())
    assert index.host_hashes == [h(1)]
    now[0] = 31.0
    moves = index.take_moves()  # the pin ran out (its request may be gone): a disk-only host keeps nothing
    assert drops(moves) == [h(1)] and index.host_hashes == []


def test_persist_writes_each_block_once_and_announces_it():
    disk = DictDisk(set())
    events = KVEventLog()
    index = TierIndex(host_capacity_blocks=0, disk=disk, events=events)
    index.persist(3, h(3), h(2), list(range(16)))
    index.persist(4, h(3), h(2), list(range(16)))  # the same content cached again later
    assert index.take_moves().of(TierPersist) == [(3, h(3))]
    (stored,) = events.take()
    assert stored == BlockStored([h(3)], h(2), list(range(16)), 16, MEDIUM_DISK)


def test_clear_host_drops_everything_unpinned():
    events = KVEventLog()
    index = TierIndex(host_capacity_blocks=4, events=events)
    index.offload(0, h(0), None, None)
    index.offload(1, h(1), None, None)
    index.take_moves()
    events.take()
    assert index.clear_host() == 2
    assert drops(index.take_moves()) == [h(0), h(1)]
    assert events.take() == [BlockRemoved([h(0), h(1)], MEDIUM_HOST)]


def test_a_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        TierIndex(host_capacity_blocks=-1)


def test_a_block_dropped_this_step_is_not_fetched_in_it_and_a_fetched_one_not_offloaded():
    """The runner drops after everything else of a step, and a fetch thread writes the host
    store at any time: a fetch of a block whose entry this step drops, or an entry made for
    a block being fetched, could lose the fetched bytes to that drop."""
    disk = DictDisk({h(1), h(2), h(3)})
    index = TierIndex(host_capacity_blocks=1, disk=disk)
    index.offload(0, h(1), None, None)
    index.offload(1, h(2), None, None)  # drops h(1) this step
    assert index.lookup([h(2), h(1), h(3)]) == (1, False)  # h(1) is not fetched while its drop is pending
    assert disk.requested == []
    index.take_moves()
    assert index.lookup([h(2), h(1), h(3)]) == (1, True)  # next step it is
    assert disk.requested == [h(1), h(3)]
    index.offload(5, h(3), None, None)  # evicted from the pool while being fetched: the fetch brings it
    assert index.take_moves().of(TierOffload) == []
    disk.complete()
    assert index.lookup([h(2), h(1), h(3)]) == (3, False)
    index.check_invariants()


def test_each_group_has_its_own_entries_and_only_group_0_is_announced():
    """The same hash in another KV cache group is another block (other layers' K/V)."""
    disk = DictDisk({tier_key(2, h(5))})
    events = KVEventLog()
    index = TierIndex(host_capacity_blocks=1, disk=disk, events=events)
    index.offload(0, h(1), None, None, group=1)
    assert index.take_moves().of(TierOffload) == [(0, tier_key(1, h(1)))] and events.take() == []
    assert index.lookup([h(1)]) == (0, False) and index.lookup([h(1)], group=1) == (1, False)
    assert index.find_each([h(1), h(5), h(6)], group=2) == [None, "disk", None]
    index.fetch_each([h(5)], group=2)
    assert disk.requested == [tier_key(2, h(5))]
    index.take_moves()  # the lookups' pins end with their schedule
    index.offload(1, h(1), None, None)  # group 0's block of the same tokens: group 1's entry makes room
    moves = index.take_moves()
    assert moves.of(TierOffload) == [(1, h(1))] and drops(moves) == [tier_key(1, h(1))]
    assert events.take() == [BlockStored([h(1)], None, [], 16, MEDIUM_HOST)]  # group 1's drop goes unannounced
    disk.complete()
    assert index.find_each([h(5)], group=2) == ["host"]
    index.load(h(5), 3, group=2)
    assert index.take_moves().of(TierLoad) == [(tier_key(2, h(5)), 3)] and index.counters.disk_hits == 1
