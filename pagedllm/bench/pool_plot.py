"""`--plot DIR`: the block pool at its fullest moment of a workload, as a PNG.

The same picture as the server's /dashboard, drawn with matplotlib from
``LLM.kv_pool_snapshot()``: one square per block, coloured by the request
that holds it (samples of one request share a colour), shared blocks labelled
with their ref count, cached-free blocks hatched, free blocks light grey.
"""

from __future__ import annotations

import math
from pathlib import Path

from pagedllm import SamplingParams
from pagedllm.bench.plotting import require_matplotlib


def peak_pool_snapshot(llm, requests) -> dict:
    """Run ``requests`` (BenchRequests) through the engine step by step and
    return the snapshot taken when the most blocks were in use. Untimed: a
    replay for the picture, after the measured run."""
    engine = llm.llm_engine
    for i, request in enumerate(requests):
        engine.add_request(f"plot-{i}", {"prompt_token_ids": request.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True))
    best, snapshot = -1, llm.kv_pool_snapshot()
    while engine.has_unfinished_requests():
        engine.step()
        in_use = llm.stats()["num_blocks_in_use"]
        if in_use > best:
            best, snapshot = in_use, llm.kv_pool_snapshot()
    return snapshot


def write_pool_plot(snapshot: dict, directory: str | Path, name: str = "kv_pool.png") -> Path:
    # Imported here so the engine never needs matplotlib (an optional extra); no pyplot, so no
    # global figure state.
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    blocks = snapshot["blocks"]
    columns = max(1, math.ceil(math.sqrt(len(blocks) * 2)))
    rows = math.ceil(len(blocks) / columns)
    figure = Figure(figsize=(min(16, 2 + columns * 0.22), 1.5 + rows * 0.22), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    palette = colormaps["tab20"]
    groups: dict[str, int] = {}
    for index, block in enumerate(blocks):
        x, y = index % columns, rows - 1 - index // columns
        face, hatch = "#e4e4e4", None
        if block["state"] == "used":
            group = (block["owners"] or ["?"])[0].split("::")[0]
            face = palette(groups.setdefault(group, len(groups)) % 20)
        elif block["state"] == "cached":
            hatch = "////"
        axes.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=face, hatch=hatch, edgecolor="#999" if hatch else face,
                                 linewidth=1.5 if block["ref_cnt"] > 1 else 0.5))
        if block["ref_cnt"] > 1:
            axes.text(x + 0.45, y + 0.45, str(block["ref_cnt"]), ha="center", va="center", fontsize=6,
                      fontweight="bold")
    axes.set_xlim(0, columns)
    axes.set_ylim(0, rows)
    axes.set_aspect("equal")
    axes.axis("off")
    counters = snapshot["counters"]
    axes.set_title(
        f"KV pool at its fullest: {counters['blocks_in_use']} of {snapshot['num_blocks']} blocks in use "
        f"({len(groups)} requests), {counters['cached_blocks']} cached; shared blocks show their ref count",
        fontsize=9,
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    figure.savefig(path, dpi=120)
    return path
