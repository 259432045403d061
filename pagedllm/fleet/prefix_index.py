"""Which replica holds which cached blocks: the router's view of the fleet's prefix caches.

Pure bookkeeping, no I/O: the replica monitor feeds it the replicas' KV events
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` of the pool and of
the host and disk tiers, whose blocks are hits too, as
``pagedllm.core.block_hash.external_block_hash`` ints), and the router adds a
*claim* for each request it sends: the blocks that request's prefill is about
to store. A claim counts as held until the replica's own event arrives or the
claim expires, so a burst of requests sharing a new system prompt, arriving
before the first of them has been computed, all go to the same replica instead
of being spread by load (SGLang's router inserts a routed prompt into its tree
for the same reason).

Sizes: one dict entry per distinct block hash the fleet holds, whose value is a
bit mask of the replicas holding it (~110 bytes an entry in CPython whatever
the number of holders, docs/distributed.md); a lookup walks the request's
hashes once with one AND per block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedllm.core.kv_events import MEDIUM_POOL


@dataclass(frozen=True)
class _Claim:
    expires_at: float
    replica: int
    hashes: tuple[int, ...]


class PrefixIndex:
    """Block hashes per replica, from events (held) and from routing (claimed).

    Replicas are small ints (their index in the router's list). Every method is
    O(number of hashes given); expired claims are dropped as time passes, in
    order (every claim lives ``claim_ttl_s``, so the oldest expires first)."""

    def __init__(self, claim_ttl_s: float = 30.0) -> None:
        if claim_ttl_s < 0:
            raise ValueError(f"claim_ttl_s must be >= 0, got {claim_ttl_s!r}")
        self.claim_ttl_s = claim_ttl_s
        # medium ("GPU": the pool, "CPU": host tier, "DISK") -> block hash -> bit mask of the replicas
        # holding it there. A block in any medium of a replica is a hit there: the tiers load it back.
        self._holders: dict[str, dict[int, int]] = {}
        self._held_count: dict[tuple[str, int], int] = {}  # (medium, replica) -> blocks held (for metrics)
        self._claims: dict[int, dict[int, int]] = {}  # block hash -> replica -> live claim count
        self._claim_order: deque[_Claim] = deque()

    # --- events -------------------------------------------------------------------------------
    def stored(self, replica: int, hashes: Iterable[int], medium: str = MEDIUM_POOL) -> None:
        table = self._holders.setdefault(medium, {})
        bit = 1 << replica
        added = 0
        for block_hash in hashes:
            holders = table.get(block_hash, 0)
            if not holders & bit:
                table[block_hash] = holders | bit
                added += 1
        self._held_count[medium, replica] = self._held_count.get((medium, replica), 0) + added

    def removed(self, replica: int, hashes: Iterable[int], medium: str = MEDIUM_POOL) -> None:
        table = self._holders.get(medium, {})
        bit = 1 << replica
        for block_hash in hashes:
            holders = table.get(block_hash, 0)
            if not holders & bit:
                continue
            self._held_count[medium, replica] -= 1
            if holders == bit:
                del table[block_hash]
            else:
                table[block_hash] = holders & ~bit

    def cleared(self, replica: int) -> None:
        """Forget everything ``replica`` held in any medium or was claimed to hold (a
        reset prefix cache, a restarted or dead replica). O(blocks in the index)."""
        bit = 1 << replica
        for medium, table in self._holders.items():
            self.removed(replica, [h for h, holders in table.items() if holders & bit], medium)
        for block_hash in [h for h, claims in self._claims.items() if replica in claims]:
            del self._claims[block_hash][replica]
            if not self._claims[block_hash]:
                del self._claims[block_hash]
        self._claim_order = deque(c for c in self._claim_order if c.replica != replica)

    # --- routing ------------------------------------------------------------------------------
    def claim(self, replica: int, hashes: Sequence[int], now: float) -> None:
        """``replica`` is about to store ``hashes`` (a request was just sent to it)."""
        self.expire(now)
        if not hashes or self.claim_ttl_s == 0:
            return
        for block_hash in hashes:
            claims = self._claims.setdefault(block_hash, {})
            claims[replica] = claims.get(replica, 0) + 1
        self._claim_order.append(_Claim(now + self.claim_ttl_s, replica, tuple(hashes)))

    def expire(self, now: float) -> None:
        while self._claim_order and self._claim_order[0].expires_at <= now:
            claim = self._claim_order.popleft()
            for block_hash in claim.hashes:
                self._drop_claim(block_hash, claim.replica)

    def leading_blocks(self, hashes: Sequence[int], replicas: Iterable[int], now: float) -> dict[int, int]:
        """For each of ``replicas``, how many leading blocks of ``hashes`` it
        holds or has been claimed to hold: the prefix a request would find cached there."""
        self.expire(now)
        matched = dict.fromkeys(replicas, 0)
        alive = 0
        for replica in matched:
            alive |= 1 << replica
        for position, block_hash in enumerate(hashes):
            held = self._claim_mask(block_hash)
            for table in self._holders.values():
                held |= table.get(block_hash, 0)
            still = alive & held
            if still != alive:
                for replica in matched:
                    if (alive & ~still) >> replica & 1:
                        matched[replica] = position
            alive = still
            if not alive:
                return matched
        for replica in matched:
            if alive >> replica & 1:
                matched[replica] = len(hashes)
        return matched

    def _claim_mask(self, block_hash: int) -> int:
        mask = 0
        for replica in self._claims.get(block_hash, ()):
            mask |= 1 << replica
        return mask

    def held_blocks(self, replica: int, medium: str = MEDIUM_POOL) -> int:
        """Blocks the replica holds in ``medium``, by its events."""
        return self._held_count.get((medium, replica), 0)

    def size(self) -> tuple[int, int]:
        """(block-hash entries over all media, live claims): the router's memory, for metrics."""
        return sum(len(table) for table in self._holders.values()), len(self._claim_order)

    def _drop_claim(self, block_hash: int, replica: int) -> None:
        claims = self._claims[block_hash]
        claims[replica] -= 1
        if claims[replica] == 0:
            del claims[replica]
        if not claims:
            del self._claims[block_hash]
