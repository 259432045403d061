"""Which prefix blocks the tiers below the pool hold, and the moves that keep it true.

Pure bookkeeping, like ``SwapSpace``: the bytes live on the runner's side
(``pagedllm.kv_tiers``). The pool's prefix cache is the top of a hierarchy:

- **host memory** (``host_capacity_blocks`` blocks, LRU): a hashed block the
  pool evicts is copied here first (an *offload*);
- **disk** (a ``DiskCatalog``): a block is written there when first cached,
  behind the step, so it outlives evictions and restarts and can be shared.

A prefix lookup that misses the pool asks host memory, then disk. A host hit
is a *load*: the block's bytes are copied into a fresh pool block before the
forward of the step that admits the request (a memory copy, never a wait).
A disk hit starts a *fetch* (a reader thread brings the files into host
memory) and the request waits in the queue, the batch carrying on without it,
until the fetch lands; then it is a host hit. A file that fails its checks is
a miss: the block is recomputed, never served.

Safety rules:
- Every decision is made here, on the scheduler's thread, and reaches the
  runner as records of the step's ``BlockMovePlan`` (``core/block_moves.py``,
  whose ``Phase`` states the order that makes them safe).
- An offload always copies into a new host entry, never over one, so an
  offload and a load in one step cannot clash.
- A landed fetch is pinned until it is loaded (or ``fetch_pin_s`` seconds
  pass: its request may have gone), and a lookup's host hits for the rest of
  that schedule: the host LRU never drops what a request is about to load.
  Pinned entries may exceed the host capacity meanwhile (a disk-only set-up
  has capacity 0 and keeps only pinned entries). Pins are counted in time,
  not schedules: an idle engine waiting for a fetch runs many empty schedules.

KV cache groups (``core.kv_groups``): a block serves one group, and the same
tokens are other K/V in another group, so every entry is keyed by its group
and hash (``tier_key``); the moves and the stores below carry that key. KV
events announce group 0's entries only, as the pool's do.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.block_moves import BlockMovePlan, TierDrop, TierLoad, TierOffload, TierPersist
from pagedllm.core.kv_events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored, KVEventLog

# Most disk blocks one lookup stats and fetches: a long prompt's prefix is
# found in pieces of this size, one fetch after the other.
MAX_FETCH_BLOCKS = 512


def tier_key(group: int, block_hash: BlockHash) -> BlockHash:
    """The tiers' key of a block of KV cache group ``group``: the hash itself in
    group 0 (the key one-group pools, their disk files and KV events use), else a
    digest of the group and the hash. A disk file's header repeats its key, so a
    file serves only the group it was written for."""
    if group == 0:
        return block_hash
    return hashlib.sha256(f"pagedllm-kv-group-{group}:".encode() + block_hash).digest()


class DiskCatalog(Protocol):
    """What the index asks of a disk tier (``pagedllm.kv_tiers.disk.DiskTier``).

    ``fetch`` returns at once: a reader thread verifies each file and puts the
    good blocks' bytes in host memory under their hash before reporting them;
    ``take_fetched`` hands over the reports since the last call."""

    @property
    def enabled(self) -> bool:
        """False once the tier turned itself off (disk full or unwritable)."""

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether a file for this block exists (it may still fail its checks)."""

    def fetch(self, block_hashes: list[BlockHash]) -> None:
        """Start reading these blocks into host memory."""

    def take_fetched(self) -> list[tuple[BlockHash, str]]:
        """(hash, outcome) for each block fetched since the last call: ``"landed"``
        (its bytes are in host memory), ``"missing"`` (the file went away) or
        ``"bad"`` (it failed its checks and was removed)."""

    def take_removed(self) -> list[BlockHash]:
        """Blocks whose files this tier removed or failed to write since the last call."""


@dataclass
class TierCounters:
    """What the tiers did, in blocks (``LLM.stats()`` and ``/metrics`` read them)."""

    host_hits: int = 0
    disk_hits: int = 0
    offloads: int = 0
    persists: int = 0
    fetches: int = 0
    fetch_failures: int = 0
    # Prompt tokens the tiers supplied: group 0's loads only (another group's load of
    # the same block is the same tokens' other layers).
    hit_tokens: int = 0


class TierIndex:
    """The host tier's LRU index, the disk tier's catalog, and the moves owed to the runner."""

    def __init__(self, host_capacity_blocks: int, disk: DiskCatalog | None = None,
                 events: KVEventLog | None = None, block_size: int = 16, fetch_pin_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if host_capacity_blocks < 0:
            raise ValueError(f"the host tier needs a non-negative capacity, got {host_capacity_blocks} blocks")
        self.host_capacity_blocks = host_capacity_blocks
        self.disk = disk
        self.events = events
        self.block_size = block_size
        self.fetch_pin_s = fetch_pin_s
        self._clock = clock
        # The host tier's keys (``tier_key``), least recently used first -> their group.
        self._host: OrderedDict[BlockHash, int] = OrderedDict()
        # Landed fetches not loaded yet -> when their pin runs out; and this schedule's lookup hits.
        self._fetch_pins: dict[BlockHash, float] = {}
        self._lookup_pins: set[BlockHash] = set()
        self._fetching: dict[BlockHash, int] = {}  # key -> group
        # Landed by a fetch and not yet loaded: a load of these counts as a disk hit.
        self._from_disk: set[BlockHash] = set()
        # Files that failed their checks this process: never asked for again.
        self._bad: set[BlockHash] = set()
        # Blocks this process knows are on disk (its writes, its fetches) -> group: not persisted again.
        self._on_disk: dict[BlockHash, int] = {}
        self._moves = BlockMovePlan()
        self._dropping: set[BlockHash] = set()  # this step's drops
        self.counters = TierCounters()

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    @property
    def host_hashes(self) -> list[BlockHash]:
        return list(self._host)

    @property
    def fetching(self) -> bool:
        """Whether a disk fetch is in flight (a request waits for it)."""
        return bool(self._fetching)

    @property
    def has_disk(self) -> bool:
        return self.disk is not None and self.disk.enabled

    # ----------------------------------------------------------- lookups

    def lookup(self, block_hashes: Sequence[BlockHash], group: int = 0) -> tuple[int, bool]:
        """How many leading ``block_hashes`` (of KV cache group ``group``) are in host
        memory now (loadable this step), and whether the request must wait: the next
        ones are on disk, being fetched (a fetch is started here for those not yet asked for)."""
        self._land_fetches()
        keys = [tier_key(group, block_hash) for block_hash in block_hashes]
        num_ready = 0
        for key in keys:
            if not self._pin_if_held(key):
                break
            num_ready += 1
        rest = keys[num_ready:num_ready + MAX_FETCH_BLOCKS]
        if not rest or not self.has_disk:
            return num_ready, False
        if rest[0] in self._fetching:
            return num_ready, True
        to_fetch: list[BlockHash] = []
        for key in rest:
            if not self._fetchable(key):
                break
            to_fetch.append(key)
        return num_ready, self._fetch(to_fetch, group)

    def find_each(self, block_hashes: Sequence[BlockHash], group: int) -> list[str | None]:
        """Where each of ``block_hashes`` (of group ``group``; not a run: a sliding
        group's window misses the pool here and there) is: ``"host"`` (loadable this
        step), ``"disk"`` (being fetched, or a file ``fetch_each`` can read) or None."""
        self._land_fetches()
        found: list[str | None] = []
        for block_hash in block_hashes:
            key = tier_key(group, block_hash)
            if self._pin_if_held(key):
                found.append("host")
            elif self.has_disk and (key in self._fetching or self._fetchable(key)):
                found.append("disk")
            else:
                found.append(None)
        return found

    def fetch_each(self, block_hashes: Sequence[BlockHash], group: int) -> None:
        """Start reading from disk those of ``block_hashes`` (of group ``group``) that
        a fetch can bring and none is bringing yet."""
        if self.has_disk:
            keys = [tier_key(group, block_hash) for block_hash in block_hashes][:MAX_FETCH_BLOCKS]
            self._fetch([key for key in keys if self._fetchable(key)], group)

    def _pin_if_held(self, key: BlockHash) -> bool:
        """Whether host memory holds ``key``; if so it is pinned for this schedule: the
        pool evictions that making room for the request may cause must not drop what
        it is about to load."""
        if key not in self._host:
            return False
        self._lookup_pins.add(key)
        return True

    def _fetchable(self, key: BlockHash) -> bool:
        """Whether a fetch of ``key`` may start now. Not a block whose host entry this
        step drops (after the loads): a fetch started now could land before that drop
        and be dropped with it."""
        return not (key in self._bad or key in self._host or key in self._dropping or key in self._fetching) \
            and self.disk.contains(key)

    def _fetch(self, keys: list[BlockHash], group: int) -> bool:
        """Start reading ``keys`` from disk; whether any was asked for."""
        if not keys:
            return False
        self._fetching.update(dict.fromkeys(keys, group))
        self.counters.fetches += len(keys)
        self.disk.fetch(keys)
        return True

    def _land_fetches(self) -> None:
        """Take the disk tier's reports: landed blocks become pinned host entries."""
        if self.disk is None or not self._fetching:
            return
        for key, outcome in self.disk.take_fetched():
            group = self._fetching.pop(key, 0)
            if outcome != "landed":
                if outcome == "bad":  # removed, but if it cannot be, never read again
                    self._bad.add(key)
                self.counters.fetch_failures += 1
                continue
            self._on_disk[key] = group
            self._from_disk.add(key)
            # Offloaded meanwhile or not, the runner holds one entry per key (the
            # same block's bytes either way): pin it for the request that waits.
            self._host[key] = group
            self._host.move_to_end(key)
            self._fetch_pins[key] = self._clock() + self.fetch_pin_s

    def wait_landed(self) -> bool:
        """Land what has arrived; True if nothing is in flight any more."""
        self._land_fetches()
        return not self._fetching

    # ------------------------------------------------------------- moves

    def load(self, block_hash: BlockHash, block_id: int, group: int = 0) -> None:
        """Copy a host entry into pool block ``block_id`` this step; the entry
        stays (unpinned, most recently used), so a later eviction of that block
        costs no copy."""
        key = tier_key(group, block_hash)
        if key not in self._host:
            raise ValueError("a tier load names a block the host tier does not hold")
        self._moves.add(TierLoad(key, block_id))
        if key in self._from_disk:
            self._from_disk.discard(key)
            self.counters.disk_hits += 1
        else:
            self.counters.host_hits += 1
        if group == 0:
            self.counters.hit_tokens += self.block_size
        self._fetch_pins.pop(key, None)
        self._host.move_to_end(key)
        self._shrink()

    def offload(self, block_id: int, block_hash: BlockHash, parent: BlockHash | None,
                token_ids: Sequence[int] | None, group: int = 0, image_keys: tuple = ()) -> None:
        """The pool evicts ``block_id`` (holding ``block_hash`` of ``group``): keep a copy in host memory.
        ``parent``, ``token_ids`` and ``image_keys`` (the images it covers) are for the events."""
        key = tier_key(group, block_hash)
        if self.host_capacity_blocks == 0 or key in self._dropping or key in self._fetching:
            # An entry dropped this step: the runner drops after it offloads, so a new
            # copy would be dropped with the old one. One being fetched: the fetch
            # brings it, and an entry dropped meanwhile could take the fetched bytes along.
            return
        if key in self._host:
            self._host.move_to_end(key)
            return
        self._moves.add(TierOffload(block_id, key))
        self._host[key] = group
        self.counters.offloads += 1
        self._announce(MEDIUM_HOST, group, block_hash, parent, token_ids, image_keys)
        self._shrink()

    def persist(self, block_id: int, block_hash: BlockHash, parent: BlockHash | None,
                token_ids: Sequence[int] | None, group: int = 0, image_keys: tuple = ()) -> None:
        """A block was just cached in the pool: write it to disk after this step's forward."""
        key = tier_key(group, block_hash)
        if not self.has_disk or key in self._on_disk:
            return
        self._on_disk[key] = group
        self._moves.add(TierPersist(block_id, key))
        self.counters.persists += 1
        self._announce(MEDIUM_DISK, group, block_hash, parent, token_ids, image_keys)

    def take_moves(self) -> BlockMovePlan:
        """The moves since the last call (the scheduler puts them in its output);
        starts the next schedule: its lookup pins, and fetch pins that ran out, are released."""
        if self.disk is not None:
            self.note_disk_removed(self.disk.take_removed())
        now = self._clock()
        expired = [h for h, until in self._fetch_pins.items() if until < now]
        for block_hash in expired:
            del self._fetch_pins[block_hash]
            self._from_disk.discard(block_hash)
        if expired or self._lookup_pins:
            self._lookup_pins.clear()
            self._shrink()
        moves, self._moves = self._moves, BlockMovePlan()
        self._dropping = set()
        return moves

    def clear_host(self) -> int:
        """Forget every unpinned host entry (a prefix-cache reset); returns how many."""
        dropped = [h for h in self._host if not self._pinned(h)]
        self._drop(dropped)
        return len(dropped)

    def _pinned(self, block_hash: BlockHash) -> bool:
        return block_hash in self._fetch_pins or block_hash in self._lookup_pins

    def _shrink(self) -> None:
        """Drop least recently used unpinned entries while over capacity."""
        excess = len(self._host) - self.host_capacity_blocks
        if excess <= 0:
            return
        victims = []
        for block_hash in self._host:
            if len(victims) == excess:
                break
            if not self._pinned(block_hash):
                victims.append(block_hash)
        self._drop(victims)

    def _drop(self, keys: list[BlockHash]) -> None:
        announced = []
        for key in keys:
            if self._host.pop(key) == 0:
                announced.append(key)
            self._moves.add(TierDrop(key))
            self._dropping.add(key)
        if announced and self.events is not None:
            self.events.append(BlockRemoved(announced, MEDIUM_HOST))

    def _announce(self, medium: str, group: int, block_hash: BlockHash, parent: BlockHash | None,
                  token_ids: Sequence[int] | None, image_keys: tuple) -> None:
        if self.events is not None and group == 0:
            self.events.append(BlockStored([block_hash], parent, list(token_ids or ()), self.block_size, medium,
                                           image_keys))

    def note_disk_removed(self, keys: list[BlockHash]) -> None:
        """The disk tier lost these files (evicted for its budget, or a write failed).
        The events name group 0's (and files of an earlier run, whose group is not known)."""
        announced = [key for key in keys if self._on_disk.pop(key, 0) == 0]
        if announced and self.events is not None:
            self.events.append(BlockRemoved(announced, MEDIUM_DISK))

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the host index breaks its capacity rule."""
        unpinned = sum(1 for block_hash in self._host if not self._pinned(block_hash))
        if unpinned > self.host_capacity_blocks:
            raise RuntimeError(f"the host tier holds {unpinned} unpinned blocks over its "
                               f"capacity of {self.host_capacity_blocks}")
