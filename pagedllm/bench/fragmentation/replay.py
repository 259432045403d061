"""One layout's replay of a trace under the simulation rules of the package
docstring: ``simulate`` returns its ``LayoutResult``."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from pagedllm.bench.fragmentation.pool import LayoutPool, PoolSpec
from pagedllm.kv_layouts import LAYOUTS
from pagedllm.bench.fragmentation.traces import TraceRequest


@dataclass
class _Live:
    """A request in the queue or running: its trace index and the tokens it holds."""

    index: int
    num_tokens: int
    total_len: int

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


@dataclass(frozen=True)
class MapEntry:
    """One running request in a memory map: its blocks, in table order, and its tokens."""

    index: int
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class LayoutResult:
    layout: str
    pool_slots: int
    block_size: int
    waste_percent: float
    held_slots: int
    needed_slots: int
    mean_table_entries: float
    mean_real_slots: float
    mean_held_slots: float
    peak_real_slots: int
    peak_held_slots: int
    internal_percent: float
    external_percent: float
    external_fragmentation_steps: int
    served: int
    rejected: int
    delayed: int
    preempted: int
    max_concurrent: int
    mean_concurrent: float
    steps: int
    peak_step: int
    batch_sizes: list[int]
    # The pool at ``peak_step`` (the first step with ``max_concurrent`` running), for the plot.
    memory_map: list[MapEntry] = field(repr=False)

    def to_json(self) -> dict:
        data = asdict(self)
        del data["memory_map"]
        return data



def waste_percent(held_slots: int, needed_slots: int) -> float:
    """100 * (held - needed) / held; 0 when nothing is held."""
    return 100.0 * (held_slots - needed_slots) / held_slots if held_slots else 0.0


def mean_or_zero(values: list[int] | list[float]) -> float:
    return sum(values) / len(values) if values else 0.0



class _Replay:
    """One layout's replay of a trace; ``run`` applies the module's simulation rules."""

    def __init__(self, trace: list[TraceRequest], spec: PoolSpec, layout: str) -> None:
        self.trace = trace
        self.spec = spec
        self.layout = layout
        self.pool = LayoutPool(spec, layout)
        order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_step, i))
        self.arrivals = deque(order)
        self.queue: deque[_Live] = deque()
        self.running: list[_Live] = []  # in admission order
        self.first_admitted: dict[int, int] = {}
        self.rejected = self.preempted = self.external_steps = 0
        self.held_at_departure: list[int] = []  # blocks, per served request
        self.needed_at_departure: list[int] = []
        self.batch_sizes: list[int] = []
        self.real_slots: list[int] = []
        self.held_slots: list[int] = []
        self.external_free_slots: list[int] = []
        self.max_concurrent = self.peak_step = 0
        self.memory_map: list[MapEntry] = []

    def run(self) -> LayoutResult:
        step = 0
        while self.arrivals or self.queue or self.running:
            self._arrive(step)
            preempted = self._decode()
            head_blocked = False if preempted else self._admit(step)
            self._measure(step, head_blocked)
            self._depart()
            step += 1
        return self._result(step)

    def _arrive(self, step: int) -> None:
        while self.arrivals and self.trace[self.arrivals[0]].arrival_step <= step:
            index = self.arrivals.popleft()
            request = self.trace[index]
            if self.spec.fits(self.layout, request.total_len):
                self.queue.append(_Live(index, request.prompt_len, request.total_len))
            else:
                self.rejected += 1

    def _decode(self) -> bool:
        """Grow every running request by a token; preempt when all stall. True if it preempted."""
        stalled = 0
        for live in self.running:
            if self.pool.grow(live.request_id, live.num_tokens):
                live.num_tokens += 1
            else:
                stalled += 1
        if not self.running or stalled < len(self.running):
            return False
        victim = self.running.pop()
        self.pool.manager.free(victim.request_id)
        self.queue.appendleft(victim)
        self.preempted += 1
        return True

    def _admit(self, step: int) -> bool:
        """Admit from the queue head until one is refused. True if a head was left blocked."""
        while self.queue:
            head = self.queue[0]
            if not self.pool.admit(head.request_id, head.num_tokens, head.total_len):
                return True
            self.running.append(self.queue.popleft())
            self.first_admitted.setdefault(head.index, step)
        return False

    def _measure(self, step: int, head_blocked: bool) -> None:
        block_size = self.spec.block_size
        free_blocks = self.pool.manager.num_free_blocks
        external = 0
        if head_blocked:
            head = self.queue[0]
            if free_blocks >= self.spec.admission_blocks(self.layout, head.num_tokens, head.total_len):
                external = free_blocks * block_size
                self.external_steps += 1
        self.external_free_slots.append(external)
        self.batch_sizes.append(len(self.running))
        self.real_slots.append(sum(live.num_tokens for live in self.running))
        self.held_slots.append(self.pool.manager.num_blocks_in_use * block_size)
        if len(self.running) > self.max_concurrent:
            self.max_concurrent = len(self.running)
            self.peak_step = step
            self.memory_map = [
                MapEntry(live.index, tuple(self.pool.manager.block_ids(live.request_id)), live.num_tokens)
                for live in self.running
            ]

    def _depart(self) -> None:
        still_running = []
        for live in self.running:
            if live.num_tokens < live.total_len:
                still_running.append(live)
                continue
            self.held_at_departure.append(len(self.pool.manager.block_ids(live.request_id)))
            self.needed_at_departure.append(live.total_len)
            self.pool.manager.free(live.request_id)
        self.running = still_running

    def _result(self, steps: int) -> LayoutResult:
        spec = self.spec
        held = sum(self.held_at_departure) * spec.block_size
        needed = sum(self.needed_at_departure)
        unused = [h - r for h, r in zip(self.held_slots, self.real_slots)]
        delayed = sum(1 for index, step in self.first_admitted.items() if step > self.trace[index].arrival_step)
        return LayoutResult(
            layout=self.layout,
            pool_slots=spec.num_slots,
            block_size=spec.block_size,
            waste_percent=waste_percent(held, needed),
            held_slots=held,
            needed_slots=needed,
            mean_table_entries=mean_or_zero(self.held_at_departure),
            mean_real_slots=mean_or_zero(self.real_slots),
            mean_held_slots=mean_or_zero(self.held_slots),
            peak_real_slots=max(self.real_slots, default=0),
            peak_held_slots=max(self.held_slots, default=0),
            internal_percent=100.0 * mean_or_zero(unused) / spec.num_slots,
            external_percent=100.0 * mean_or_zero(self.external_free_slots) / spec.num_slots,
            external_fragmentation_steps=self.external_steps,
            served=len(self.held_at_departure),
            rejected=self.rejected,
            delayed=delayed,
            preempted=self.preempted,
            max_concurrent=self.max_concurrent,
            mean_concurrent=mean_or_zero(self.batch_sizes),
            steps=steps,
            peak_step=self.peak_step,
            batch_sizes=self.batch_sizes,
            memory_map=self.memory_map,
        )


def simulate(trace: list[TraceRequest], spec: PoolSpec, layout: str) -> LayoutResult:
    """Replay ``trace`` through one layout's manager under the module's simulation rules."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return _Replay(trace, spec, layout).run()
