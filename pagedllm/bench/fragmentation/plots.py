"""The three PNG plots of a fragmentation report (``--plot DIR``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.bench.fragmentation.report import FragmentationReport
from pagedllm.bench.plotting import require_matplotlib

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def write_plots(report: FragmentationReport, directory: str | Path) -> list[Path]:
    """Write ``waste_vs_block_size.png``, ``memory_map.png`` and ``batch_size.png`` into
    ``directory`` (created if missing) and return their paths."""
    # Imported here so the replay itself needs neither matplotlib (an optional extra) nor numpy.
    # Figures are made without pyplot and drawn by Agg, so no GUI backend or global figure state
    # is involved.
    require_matplotlib()
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
