"""`pagedllm bench fragmentation`: how much of the KV pool holds real tokens, contiguous
reservations against paged blocks, replaying the same trace through the same pool.

Bookkeeping only: requests are lengths, the allocators are the engine's own
``ContiguousKVCacheManager`` and ``KVCacheManager`` (prefix caching off), and no model or
tensor is involved.

Simulation rules
----------------
- Time is discrete steps. Every request arrives at step 0, or, with ``arrival_rate`` R, as a
  Poisson process of R requests per step: exponential gaps drawn from
  ``random.Random(f"{seed}:arrivals")``, arrival step = floor of the arrival time.
- A request that can never fit is rejected when it arrives: one longer than
  ``max_model_len``; under contiguous, one whose reservation is larger than the pool; under
  paged, one whose final length needs more blocks than the pool has.
- Each step, in this order:

  1. Decode: every running request, in admission order, grows by one token
     (``allocate_slots(rid, length, 1)``). A paged request that gets no block stalls for the
     step; if every running request stalls, the latest admitted one is preempted: freed, put
     back at the head of the queue keeping its tokens (recompute re-prefills all of them), and
     counted.
  2. Admission, first come first served with head-of-line blocking: the queue head is admitted
     when ``allocate_slots(rid, 0, tokens)`` succeeds (tokens = ``prompt_len``, or all a
     preempted request had); the first refusal ends admission for the step. A step that
     preempted admits nobody, so the freed blocks go to the stalled requests and not straight
     back to the request just evicted.
  3. Measure the pool: this is the state the step's forward pass would run on.
  4. Departure: a request that holds ``prompt_len + output_len`` tokens is freed.

  The replay ends when every request has departed or been rejected.
- Contiguous reservations (``reservation``): ``max`` reserves ``max_model_len`` slots per
  request (the PagedAttention paper's baseline and the toy allocator's); ``pow2`` the next
  power of two of the final length and ``oracle`` the final length itself (the paper's
  Orca (Pow2) and Orca (Oracle), which assume the output length is known in advance), both
  capped at ``max_model_len``. Under ``max`` every run has the same length and starts at a
  multiple of it, so every hole except the pool's tail is a whole number of runs: external
  fragmentation needs reservations of different sizes.

Metrics (per layout)
--------------------
- ``waste_percent`` = 100 * (held - needed) / held, summed over served requests at their
  final length: held = slots of the blocks the request holds when it departs (contiguous:
  its whole reservation; paged: ceil(len / B) * B), needed = prompt_len + output_len.
- ``internal_percent``: mean over steps of the slots held but holding no token (the empty
  part of reservations, or of paged last blocks), as % of the pool.
- ``external_percent``: mean over steps of the free slots in steps where admission stopped at
  a queue head that the free slots would fit in total (so no single hole fits it), as % of
  the pool. A paged admission fails only when too few blocks are free, so paged measures 0.
- ``delayed``: first admitted at a later step than it arrived.
- The block-size sweep keeps the pool's size in tokens and scales ``num_blocks``. Waste
  depends only on which requests are served and their final lengths, and every request
  that can fit is served in the end (an empty pool admits it), so the sweep computes waste
  and block-table entries from the trace directly instead of replaying it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.bench.json_records import read_json_records
from pagedllm.bench.record import append_result
from pagedllm.core.contiguous import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CONTIGUOUS = "contiguous"
PAGED = "paged"
LAYOUTS = (CONTIGUOUS, PAGED)
RESERVATIONS = ("max", "pow2", "oracle")
SWEEP_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)

# The ShareGPT-like default trace: log-normal lengths whose means are ShareGPT's (161 prompt,
# 338 output tokens, as the PagedAttention paper reports them); the spreads give the long
# tails real chat traffic has.
SHAREGPT_PROMPT_MEAN, SHAREGPT_PROMPT_SIGMA = 161.0, 1.0
SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA = 338.0, 0.9


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    arrival_step: int = 0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class PoolSpec:
    """The KV pool both layouts share, and how the contiguous layout reserves."""

    num_blocks: int
    block_size: int
    max_model_len: int
    reservation: str = "max"

    def __post_init__(self) -> None:
        if self.reservation not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {self.reservation!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def reserved_tokens(self, total_len: int) -> int:
        """Slots a contiguous reservation takes for a request of final length ``total_len``."""
        if self.reservation == "max":
            return self.max_model_len
        if self.reservation == "pow2":
            return min(1 << (total_len - 1).bit_length(), self.max_model_len)
        return total_len

    def final_blocks(self, layout: str, total_len: int) -> int:
        """Blocks a request holds when it reaches its final length."""
        tokens = self.reserved_tokens(total_len) if layout == CONTIGUOUS else total_len
        return cdiv(tokens, self.block_size)

    def admission_blocks(self, layout: str, num_tokens: int, total_len: int) -> int:
        """Free blocks an admission with ``num_tokens`` tokens needs: contiguous reserves the
        whole run up front, paged only the blocks the tokens fill."""
        if layout == CONTIGUOUS:
            return self.final_blocks(layout, total_len)
        return cdiv(num_tokens, self.block_size)

    def fits(self, layout: str, total_len: int) -> bool:
        """False for a request the layout can never serve in this pool (rejected on arrival)."""
        return total_len <= self.max_model_len and self.final_blocks(layout, total_len) <= self.num_blocks


class _Pool:
    """One layout's manager behind the operations the replay needs."""

    def __init__(self, spec: PoolSpec, layout: str) -> None:
        self.spec = spec
        self.layout = layout
        self.manager: ContiguousKVCacheManager | KVCacheManager
        if layout == CONTIGUOUS:
            # Per-request mode: every run is sized at admission by reserve_for.
            self.manager = ContiguousKVCacheManager(spec.num_blocks, spec.block_size, None)
        else:
            self.manager = KVCacheManager(spec.num_blocks, spec.block_size, enable_prefix_caching=False)

    def admit(self, request_id: str, num_tokens: int, total_len: int) -> bool:
        if self.layout == CONTIGUOUS:
            # max reserves max_model_len for everyone; pow2 and oracle size each request apart.
            self.manager.reserve_for(request_id, self.spec.reserved_tokens(total_len))
        return self.manager.allocate_slots(request_id, 0, num_tokens) is not None

    def grow(self, request_id: str, num_tokens: int) -> bool:
        return self.manager.allocate_slots(request_id, num_tokens, 1) is not None

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        return self.manager.get_block_ids(request_id)

    @property
    def free_blocks(self) -> int:
        return self.manager.num_free_blocks

    @property
    def blocks_in_use(self) -> int:
        return self.manager.num_blocks_in_use


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


@dataclass(frozen=True)
class SweepRow:
    block_size: int
    num_blocks: int
    contiguous_waste_percent: float
    contiguous_table_entries: float
    paged_waste_percent: float
    paged_table_entries: float


@dataclass
class FragmentationReport:
    spec: PoolSpec
    num_requests: int
    mean_prompt_len: float
    mean_output_len: float
    results: dict[str, LayoutResult]
    sweep: list[SweepRow]

    def to_json(self) -> dict:
        data: dict = {layout: result.to_json() for layout, result in self.results.items()}
        data["block_size_sweep"] = [asdict(row) for row in self.sweep]
        data["config"] = {
            **asdict(self.spec),
            "pool_slots": self.spec.num_slots,
            "num_requests": self.num_requests,
            "mean_prompt_len": self.mean_prompt_len,
            "mean_output_len": self.mean_output_len,
        }
        return data


def waste_percent(held_slots: int, needed_slots: int) -> float:
    """100 * (held - needed) / held; 0 when nothing is held."""
    return 100.0 * (held_slots - needed_slots) / held_slots if held_slots else 0.0


def _mean(values: list[int] | list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def sharegpt_like_trace(num_requests: int, max_model_len: int, seed: int = 0) -> list[TraceRequest]:
    """``num_requests`` lengths drawn like ShareGPT's, all arriving at step 0.

    Prompt and output lengths are log-normal with means ``SHAREGPT_PROMPT_MEAN`` /
    ``SHAREGPT_OUTPUT_MEAN`` and log-space spreads ``SHAREGPT_*_SIGMA`` (mu = ln(mean) -
    sigma^2 / 2), rounded, then clipped: the prompt to [1, max_model_len - 1] and the output
    to [1, max_model_len - prompt], so every request fits the model. ``random.Random(seed)``.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2 for a prompt and an output, got {max_model_len}")
    rng = random.Random(seed)

    def draw(mean: float, sigma: float) -> int:
        return round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))

    trace = []
    for _ in range(num_requests):
        prompt = min(max(1, draw(SHAREGPT_PROMPT_MEAN, SHAREGPT_PROMPT_SIGMA)), max_model_len - 1)
        output = min(max(1, draw(SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA)), max_model_len - prompt)
        trace.append(TraceRequest(prompt, output))
    return trace


def load_trace(path: str) -> list[TraceRequest]:
    """A JSON list of ``{"prompt_len": P, "output_len": O}`` (P >= 1, O >= 0), arriving at step 0."""
    trace = read_json_records(
        path, "prompt_len, output_len",
        lambda item: TraceRequest(int(item["prompt_len"]), int(item["output_len"])),
    )
    bad = [i for i, r in enumerate(trace) if r.prompt_len < 1 or r.output_len < 0]
    if bad:
        raise ValueError(f"{path}: item {bad[0]} needs prompt_len >= 1 and output_len >= 0")
    return trace


def poisson_arrivals(trace: list[TraceRequest], arrival_rate: float, seed: int = 0) -> list[TraceRequest]:
    """The trace, in order, arriving as a Poisson process of ``arrival_rate`` requests per step;
    the first arrives at step 0."""
    rng = random.Random(f"{seed}:arrivals")
    arrivals, time = [], 0.0
    for request in trace:
        arrivals.append(TraceRequest(request.prompt_len, request.output_len, math.floor(time)))
        time += rng.expovariate(arrival_rate)
    return arrivals


class _Replay:
    """One layout's replay of a trace; ``run`` applies the module's simulation rules."""

    def __init__(self, trace: list[TraceRequest], spec: PoolSpec, layout: str) -> None:
        self.trace = trace
        self.spec = spec
        self.layout = layout
        self.pool = _Pool(spec, layout)
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
        self.pool.free(victim.request_id)
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
        free_blocks = self.pool.free_blocks
        external = 0
        if head_blocked:
            head = self.queue[0]
            if free_blocks >= self.spec.admission_blocks(self.layout, head.num_tokens, head.total_len):
                external = free_blocks * block_size
                self.external_steps += 1
        self.external_free_slots.append(external)
        self.batch_sizes.append(len(self.running))
        self.real_slots.append(sum(live.num_tokens for live in self.running))
        self.held_slots.append(self.pool.blocks_in_use * block_size)
        if len(self.running) > self.max_concurrent:
            self.max_concurrent = len(self.running)
            self.peak_step = step
            self.memory_map = [
                MapEntry(live.index, tuple(self.pool.block_ids(live.request_id)), live.num_tokens)
                for live in self.running
            ]

    def _depart(self) -> None:
        still_running = []
        for live in self.running:
            if live.num_tokens < live.total_len:
                still_running.append(live)
                continue
            self.held_at_departure.append(len(self.pool.block_ids(live.request_id)))
            self.needed_at_departure.append(live.total_len)
            self.pool.free(live.request_id)
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
            mean_table_entries=_mean(self.held_at_departure),
            mean_real_slots=_mean(self.real_slots),
            mean_held_slots=_mean(self.held_slots),
            peak_real_slots=max(self.real_slots, default=0),
            peak_held_slots=max(self.held_slots, default=0),
            internal_percent=100.0 * _mean(unused) / spec.num_slots,
            external_percent=100.0 * _mean(self.external_free_slots) / spec.num_slots,
            external_fragmentation_steps=self.external_steps,
            served=len(self.held_at_departure),
            rejected=self.rejected,
            delayed=delayed,
            preempted=self.preempted,
            max_concurrent=self.max_concurrent,
            mean_concurrent=_mean(self.batch_sizes),
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


def block_size_sweep(
    trace: list[TraceRequest], spec: PoolSpec, block_sizes: tuple[int, ...] = SWEEP_BLOCK_SIZES
) -> list[SweepRow]:
    """Waste % and mean block-table entries per served sequence for each block size, with the
    pool kept at ``spec.num_slots`` tokens (``num_blocks`` = slots // block size)."""
    rows = []
    for block_size in block_sizes:
        sized = PoolSpec(spec.num_slots // block_size, block_size, spec.max_model_len, spec.reservation)
        figures = {layout: _final_waste(trace, sized, layout) for layout in LAYOUTS}
        rows.append(SweepRow(block_size, sized.num_blocks, *figures[CONTIGUOUS], *figures[PAGED]))
    return rows


def _final_waste(trace: list[TraceRequest], spec: PoolSpec, layout: str) -> tuple[float, float]:
    """(waste %, mean table entries) over the requests the layout serves, at their final lengths."""
    served = [r.total_len for r in trace if spec.fits(layout, r.total_len)]
    blocks = [spec.final_blocks(layout, total_len) for total_len in served]
    return waste_percent(sum(blocks) * spec.block_size, sum(served)), _mean(blocks)


def run_fragmentation(trace: list[TraceRequest], spec: PoolSpec) -> FragmentationReport:
    """Both layouts' replays of ``trace`` in ``spec``'s pool, and the block-size sweep."""
    results = {layout: simulate(trace, spec, layout) for layout in LAYOUTS}
    return FragmentationReport(
        spec,
        len(trace),
        _mean([r.prompt_len for r in trace]),
        _mean([r.output_len for r in trace]),
        results,
        block_size_sweep(trace, spec),
    )


def format_tables(report: FragmentationReport) -> str:
    """The per-layout table and the block-size sweep table, in Markdown."""
    lines = [
        "| layout | waste | internal (% pool) | external (% pool) | real tokens mean / peak (% pool) "
        "| served | rejected | delayed | preempted | max concurrent | mean concurrent | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results.values():
        real = f"{100 * r.mean_real_slots / r.pool_slots:.1f}% / {100 * r.peak_real_slots / r.pool_slots:.1f}%"
        lines.append(
            f"| {r.layout} | {r.waste_percent:.1f}% | {r.internal_percent:.1f}% | {r.external_percent:.1f}% | {real} "
            f"| {r.served} | {r.rejected} | {r.delayed} | {r.preempted} | {r.max_concurrent} "
            f"| {r.mean_concurrent:.1f} | {r.steps} |"
        )
    lines += [
        "",
        f"Block-size sweep (pool kept at {report.spec.num_slots} token slots):",
        "",
        "| block size | blocks | paged waste | paged table entries / seq | contiguous waste "
        "| contiguous table entries / seq |",
        "|---|---|---|---|---|---|",
    ]
    for row in report.sweep:
        lines.append(
            f"| {row.block_size} | {row.num_blocks} | {row.paged_waste_percent:.1f}% | {row.paged_table_entries:.1f} "
            f"| {row.contiguous_waste_percent:.1f}% | {row.contiguous_table_entries:.1f} |"
        )
    return "\n".join(lines)


def describe(report: FragmentationReport, trace_name: str) -> str:
    """One paragraph naming the trace, the pool and the reservation policy."""
    spec = report.spec
    return (
        f"{report.num_requests} requests ({trace_name}; mean prompt {report.mean_prompt_len:.1f}, "
        f"mean output {report.mean_output_len:.1f} tokens); pool {spec.num_blocks} blocks x {spec.block_size} tokens "
        f"= {spec.num_slots} slots, max_model_len {spec.max_model_len}, contiguous reservation '{spec.reservation}'."
    )


def write_plots(report: FragmentationReport, directory: str | Path) -> list[Path]:
    """Write ``waste_vs_block_size.png``, ``memory_map.png`` and ``batch_size.png`` into
    ``directory`` (created if missing) and return their paths."""
    # Imported here so the replay itself needs neither matplotlib nor numpy. Figures are made
    # without pyplot and drawn by Agg, so no GUI backend or global figure state is involved.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (
        ("waste_vs_block_size.png", _draw_sweep),
        ("memory_map.png", _draw_memory_maps),
        ("batch_size.png", _draw_batch_sizes),
    ):
        figure = Figure(figsize=(9, 5.5), layout="constrained")
        FigureCanvasAgg(figure)
        draw(figure, report)
        path = directory / name
        figure.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _draw_sweep(figure: Figure, report: FragmentationReport) -> None:
    """Bars: waste % per block size for both layouts; line (right axis, log): table entries."""
    ax = figure.add_subplot()
    labels = [str(row.block_size) for row in report.sweep]
    positions = range(len(labels))
    width = 0.38
    series = (
        ("paged", [row.paged_waste_percent for row in report.sweep], -width / 2, "tab:blue"),
        ("contiguous", [row.contiguous_waste_percent for row in report.sweep], width / 2, "tab:gray"),
    )
    for name, values, offset, colour in series:
        bars = ax.bar([p + offset for p in positions], values, width, label=f"{name} waste", color=colour)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(list(positions), labels)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("waste: % of held slots without a token")
    ax.set_ylim(0, 100)
    entries = ax.twinx()
    entries.plot(positions, [row.paged_table_entries for row in report.sweep], "o-", color="tab:orange",
                 label="paged table entries / seq")
    entries.plot(positions, [row.contiguous_table_entries for row in report.sweep], "s--", color="tab:red",
                 label="contiguous table entries / seq")
    entries.set_yscale("log")
    entries.set_ylabel("block-table entries per sequence (log)")
    handles = ax.get_legend_handles_labels()
    more = entries.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper center", fontsize=8)
    ax.set_title(f"Block size trade-off, pool of {report.spec.num_slots} token slots")


def _draw_memory_maps(figure: Figure, report: FragmentationReport) -> None:
    """One panel per layout: the pool at its peak-concurrency step, a colour per request;
    token slots solid, held-but-empty slots pale, free slots white."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    spec = report.spec
    # Rows of whole blocks that tile the pool exactly, about twice as wide as tall.
    target = math.sqrt(2 * spec.num_slots) / spec.block_size
    divisors = [d for d in range(1, spec.num_blocks + 1) if spec.num_blocks % d == 0]
    blocks_per_row = min(divisors, key=lambda d: abs(d - target))
    columns = blocks_per_row * spec.block_size
    rows = spec.num_blocks // blocks_per_row
    # tab10: ten saturated colours, none of which looks like another one's pale shade.
    palette = colormaps["tab10"]
    for panel, result in enumerate(report.results.values(), 1):
        image = np.ones((spec.num_slots, 3))
        for position, entry in enumerate(result.memory_map):
            colour = np.array(palette(position % 10)[:3])
            pale = 0.3 * colour + 0.7
            for table_index, block_id in enumerate(entry.block_ids):
                start = block_id * spec.block_size
                filled = min(max(entry.num_tokens - table_index * spec.block_size, 0), spec.block_size)
                image[start:start + filled] = colour
                image[start + filled:start + spec.block_size] = pale
        ax = figure.add_subplot(len(report.results), 1, panel)
        ax.imshow(image.reshape(rows, columns, 3), aspect="auto", interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(f"{rows} rows x {columns} slots", fontsize=8)
        real = 100 * sum(entry.num_tokens for entry in result.memory_map) / spec.num_slots
        held = 100 * sum(len(entry.block_ids) for entry in result.memory_map) * spec.block_size / spec.num_slots
        ax.set_title(
            f"{result.layout}: step {result.peak_step}, {len(result.memory_map)} running; "
            f"tokens {real:.1f}%, held but empty {held - real:.1f}%, free {100 - held:.1f}% of the pool",
            fontsize=9,
        )
    legend = [
        Patch(color=palette(0)[:3], label="slot holding a token"),
        Patch(color=0.3 * np.array(palette(0)[:3]) + 0.7, label="held, no token yet"),
        Patch(facecolor="white", edgecolor="black", label="free"),
    ]
    figure.legend(handles=legend, loc="outside lower center", ncol=3, fontsize=8)


def _draw_batch_sizes(figure: Figure, report: FragmentationReport) -> None:
    """Running sequences per step, both layouts."""
    ax = figure.add_subplot()
    for result in report.results.values():
        ax.plot(result.batch_sizes, drawstyle="steps-post", label=f"{result.layout} (max {result.max_concurrent})")
    ax.set_xlabel("step")
    ax.set_ylabel("running sequences")
    ax.set_title(f"Batch size over time, pool of {report.spec.num_slots} token slots")
    ax.legend()


def build_arg_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset", default=None, metavar="PATH", help='JSON list of {"prompt_len", "output_len"} (default: ShareGPT-like trace)'
    )
    parser.add_argument("--num-requests", type=_positive_int, default=1000, help="requests in the default trace")
    parser.add_argument("--num-blocks", type=_positive_int, default=2048, help="KV pool size in blocks")
    parser.add_argument("--block-size", type=_block_size, default=16, help="tokens per block (power of two)")
    parser.add_argument("--max-model-len", type=_positive_int, default=2048, help="longest request; the 'max' reservation")
    parser.add_argument(
        "--reservation",
        choices=RESERVATIONS,
        default="max",
        help="contiguous reservation: max_model_len (max), next power of two of the final length (pow2) or the final length (oracle)",
    )
    parser.add_argument(
        "--arrival-rate", type=_positive_float, default=None, help="Poisson arrivals, requests per step (default: all at step 0)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the default trace and the arrivals")
    parser.add_argument("--json", action="store_true", help="print only a JSON object")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write the three PNG plots into DIR")
    parser.add_argument("--record", default=None, metavar="FILE", help="append the result tables to FILE")


def main(args: argparse.Namespace) -> None:
    """Replay the trace through both layouts, print the tables (or only JSON with ``--json``),
    write the plots with ``--plot`` and append the tables to ``--record``."""
    if args.dataset:
        trace, trace_name = load_trace(args.dataset), args.dataset
    else:
        trace = sharegpt_like_trace(args.num_requests, args.max_model_len, args.seed)
        trace_name = f"ShareGPT-like log-normal lengths, seed {args.seed}"
    if args.arrival_rate is not None:
        trace = poisson_arrivals(trace, args.arrival_rate, args.seed)
        trace_name += f", Poisson arrivals at {args.arrival_rate:g} per step"
    else:
        trace_name += ", all arriving at step 0"
    spec = PoolSpec(args.num_blocks, args.block_size, args.max_model_len, args.reservation)
    report = run_fragmentation(trace, spec)
    tables = format_tables(report)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(describe(report, trace_name))
        print()
        print(tables)
    if args.plot:
        write_plots(report, args.plot)
    if args.record:
        append_result(args.record, getattr(args, "argv", None), describe(report, trace_name), tables)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _block_size(text: str) -> int:
    value = int(text)
    if value < 1 or value > 256 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two in [1, 256], got {value}")
    return value
