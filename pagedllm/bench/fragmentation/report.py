"""Both layouts' replays of one trace, the block-size sweep, and the tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedllm.bench.fragmentation.pool import PoolSpec
from pagedllm.bench.fragmentation.replay import LayoutResult, mean_or_zero, simulate, waste_percent
from pagedllm.kv_layouts import CONTIGUOUS, LAYOUTS, PAGED
from pagedllm.bench.fragmentation.traces import TraceRequest
from pagedllm.bench.tables import markdown_table

SWEEP_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)


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
    return waste_percent(sum(blocks) * spec.block_size, sum(served)), mean_or_zero(blocks)


def run_fragmentation(trace: list[TraceRequest], spec: PoolSpec) -> FragmentationReport:
    """Both layouts' replays of ``trace`` in ``spec``'s pool, and the block-size sweep."""
    results = {layout: simulate(trace, spec, layout) for layout in LAYOUTS}
    return FragmentationReport(
        spec,
        len(trace),
        mean_or_zero([r.prompt_len for r in trace]),
        mean_or_zero([r.output_len for r in trace]),
        results,
        block_size_sweep(trace, spec),
    )


def format_tables(report: FragmentationReport) -> str:
    """The per-layout table and the block-size sweep table, in Markdown."""
    layouts = markdown_table(
        ["layout", "waste", "internal (% pool)", "external (% pool)", "real tokens mean / peak (% pool)", "served",
         "rejected", "delayed", "preempted", "max concurrent", "mean concurrent", "steps"],
        [[r.layout, f"{r.waste_percent:.1f}%", f"{r.internal_percent:.1f}%", f"{r.external_percent:.1f}%",
          f"{100 * r.mean_real_slots / r.pool_slots:.1f}% / {100 * r.peak_real_slots / r.pool_slots:.1f}%",
          r.served, r.rejected, r.delayed, r.preempted, r.max_concurrent, f"{r.mean_concurrent:.1f}", r.steps]
         for r in report.results.values()])
    sweep = markdown_table(
        ["block size", "blocks", "paged waste", "paged table entries / seq", "contiguous waste",
         "contiguous table entries / seq"],
        [[row.block_size, row.num_blocks, f"{row.paged_waste_percent:.1f}%", f"{row.paged_table_entries:.1f}",
          f"{row.contiguous_waste_percent:.1f}%", f"{row.contiguous_table_entries:.1f}"] for row in report.sweep])
    return f"{layouts}\n\nBlock-size sweep (pool kept at {report.spec.num_slots} token slots):\n\n{sweep}"


def describe(report: FragmentationReport, trace_name: str) -> str:
    """One paragraph naming the trace, the pool and the reservation policy."""
    spec = report.spec
    return (
        f"{report.num_requests} requests ({trace_name}; mean prompt {report.mean_prompt_len:.1f}, "
        f"mean output {report.mean_output_len:.1f} tokens); pool {spec.num_blocks} blocks x {spec.block_size} tokens "
        f"= {spec.num_slots} slots, max_model_len {spec.max_model_len}, contiguous reservation '{spec.reservation}'."
    )
