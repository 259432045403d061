"""The ranked queue of sequences that are not on the device."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from pagedllm.core.request import Request

RankKey = tuple[int, ...]


class WaitingQueue:
    """Waiting, preempted and swapped-out sequences, best rank first.

    ``push``, ``peek`` and ``discard`` are O(log n) amortized: a discarded
    entry is marked dead and dropped when it reaches the top of the heap
    (lazy deletion), so removing a finished or admitted sequence never scans.
    ``len()`` counts live entries only.
    """

    def __init__(self, rank: Callable[[Request], RankKey]) -> None:
        self._rank = rank
        self._heap: list[list] = []
        self._live: dict[str, list] = {}  # sequence id -> its heap entry
        # Breaks rank ties (beams share arrival and sample index) in push order.
        self._push_counter = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._live

    def __iter__(self) -> Iterator[Request]:
        """The live sequences, in no particular order."""
        return (entry[-1] for entry in list(self._live.values()))

    def push(self, request: Request) -> None:
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry = [*self._rank(request), next(self._push_counter), request]
        self._live[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def peek(self) -> Request | None:
        """The best-ranked live sequence, left in the queue."""
        while self._heap and self._live.get(self._heap[0][-1].request_id) is not self._heap[0]:
            heapq.heappop(self._heap)
        return self._heap[0][-1] if self._heap else None

    def discard(self, request: Request) -> None:
        """Drop the sequence if it waits (no-op otherwise)."""
        self._live.pop(request.request_id, None)
