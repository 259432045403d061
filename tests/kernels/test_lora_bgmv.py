"""``lora_bgmv`` (lora_ops.cpp, issue 44): each row of a mixed batch adds its
own LoRA adapter's ``B @ (A @ x[r])`` to a column slice of ``out``, A and B read
from two flat pools at per-row offsets (rank 0: no adapter). Checked against an
fp64 per-row PyTorch loop over the same stored values, for fp32 and bf16, over
batch sizes from a decode step to a prefill, mixed ranks, adapters shared by
rows, ``out`` as a column slice of a wider tensor and as strided rows; and each
argument check refuses with a RuntimeError."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels

IN_FEATURES = 96
OUT_WIDTH = 200  # the wider output the LoRA columns are a slice of
OUT_COL, OUT_SIZE = 40, 150  # not a multiple of 16: a partial block of columns
RANKS = [0, 4, 8, 16, 64]


def kernels():
    module = load_cpu_kernels()
    if module is None:
        pytest.skip("C++ CPU kernels unavailable")
    return module


def adapter_pools(ranks: list[int], dtype: torch.dtype, gen: torch.Generator):
    """Flat pools holding one adapter per rank (a gap before each), and its offsets."""
    a_parts, b_parts, a_offsets, b_offsets = [], [], [], []
    a_used = b_used = 0
    for rank in ranks:
        a_parts.append(torch.randn(3 + rank * IN_FEATURES, generator=gen))
        b_parts.append(torch.randn(5 + OUT_SIZE * rank, generator=gen) / max(rank, 1) ** 0.5)
        a_offsets.append(a_used + 3)
        b_offsets.append(b_used + 5)
        a_used += a_parts[-1].numel()
        b_used += b_parts[-1].numel()
    return torch.cat(a_parts).to(dtype), torch.cat(b_parts).to(dtype), a_offsets, b_offsets


def batch(rows: int, dtype: torch.dtype, seed: int):
    """x, a wide out, pools, and per-row (a_offset, b_offset, rank) for ``rows`` rows:
    rows cycle over the adapters unevenly, so adapters are shared and ranks mixed."""
    gen = torch.Generator().manual_seed(seed)
    a_pool, b_pool, a_offsets, b_offsets = adapter_pools(RANKS, dtype, gen)
    choice = torch.randint(0, len(RANKS), (rows,), generator=gen)
    if rows > 1:
        choice[:2] = RANKS.index(16)  # two rows sharing one adapter, in every batch past one row
    pick = choice.tolist()
    index = {name: torch.tensor([values[i] for i in pick], dtype=torch.int64)
             for name, values in (("a", a_offsets), ("b", b_offsets), ("rank", RANKS))}
    x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype)
    out = torch.randn(rows, OUT_WIDTH, generator=gen).to(dtype)
    return x, out, a_pool, b_pool, index


def reference(out, x, a_pool, b_pool, index, out_col, out_size):
    """fp64 per-row loop over the stored values: out with each row's delta added."""
    expected = out.double().clone()
    for r in range(x.shape[0]):
        rank = int(index["rank"][r])
        if rank == 0:
            continue
        a0, b0 = int(index["a"][r]), int(index["b"][r])
        a = a_pool[a0:a0 + rank * x.shape[1]].double().view(rank, x.shape[1])
        b = b_pool[b0:b0 + out_size * rank].double().view(out_size, rank)
        expected[r, out_col:out_col + out_size] += b @ (a @ x[r].double())
    return expected


def call(module, out, x, a_pool, b_pool, index, out_col=OUT_COL, out_size=OUT_SIZE):
    module.lora_bgmv(out, x, a_pool, b_pool, index["a"], index["b"], index["rank"], out_col, out_size)


@pytest.mark.parametrize("rows", [1, 3, 8, 37, 300])
def test_fp32_matches_an_fp64_loop(rows: int) -> None:
    module = kernels()
    x, out, a_pool, b_pool, index = batch(rows, torch.float32, seed=rows)
    expected = reference(out, x, a_pool, b_pool, index, OUT_COL, OUT_SIZE)
    call(module, out, x, a_pool, b_pool, index)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * scale)
    # Columns outside the slice are untouched, and so are rows without an adapter.
    assert torch.equal(out[:, :OUT_COL].double(), expected[:, :OUT_COL])
    assert torch.equal(out[:, OUT_COL + OUT_SIZE:].double(), expected[:, OUT_COL + OUT_SIZE:])
    bare = index["rank"] == 0
    assert torch.equal(out[bare].double(), expected[bare])


@pytest.mark.parametrize("rows", [1, 3, 8, 37, 300])
def test_bf16_rounds_out_plus_delta_once(rows: int) -> None:
    """The sum is fp32 and rounded to bf16 once: the result is within one bf16
    rounding (half an ulp, plus fp32 summation noise) of the exact sum."""
    module = kernels()
    x, out, a_pool, b_pool, index = batch(rows, torch.bfloat16, seed=100 + rows)
    expected = reference(out, x, a_pool, b_pool, index, OUT_COL, OUT_SIZE)
    call(module, out, x, a_pool, b_pool, index)
    error = (out.double() - expected).abs()
    ulp = expected.abs() * 2.0 ** -8  # bf16 spacing is at most |v| * 2^-7: half of it rounds
    assert bool((error <= ulp + 1e-4 * expected.abs().max()).all())
    bare = index["rank"] == 0
    assert torch.equal(out[bare].double(), expected[bare])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_of_out(dtype: torch.dtype) -> None:
    """out is every other row of a wider tensor and a column slice of it (as
    the fused q|k|v output's k part), with the kernel's out_col counted inside
    the view; everything outside the written block is untouched."""
    module = kernels()
    x, _, a_pool, b_pool, index = batch(8, dtype, seed=7)
    base = torch.randn(16, OUT_WIDTH + 30, dtype=torch.float32).to(dtype)
    view = base[::2, 10:10 + OUT_WIDTH]
    assert view.stride(0) == 2 * (OUT_WIDTH + 30) and not view.is_contiguous()
    expected_base = base.double().clone()
    expected_base[::2, 10:10 + OUT_WIDTH] = reference(view, x, a_pool, b_pool, index, OUT_COL, OUT_SIZE)
    call(module, view, x, a_pool, b_pool, index)
    scale = expected_base.abs().max().item()
    atol = 1e-5 * scale if dtype == torch.float32 else 2.0 ** -7 * scale
    torch.testing.assert_close(base.double(), expected_base, rtol=0, atol=atol)
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[::2, 10 + OUT_COL:10 + OUT_COL + OUT_SIZE] = False
    assert torch.equal(base.double()[untouched], expected_base[untouched])


def test_no_adapter_anywhere_leaves_out_alone() -> None:
    module = kernels()
    x, out, a_pool, b_pool, index = batch(5, torch.float32, seed=3)
    index["rank"].zero_()
    index["a"].fill_(10 ** 12)  # never read for a row of rank 0
    before = out.clone()
    call(module, out, x, a_pool, b_pool, index)
    assert torch.equal(out, before)


def _refused(module, **change) -> None:
    x, out, a_pool, b_pool, index = batch(4, torch.float32, seed=11)
    args = {"out": out, "x": x, "a_pool": a_pool, "b_pool": b_pool, "a_offsets": index["a"],
            "b_offsets": index["b"], "ranks": index["rank"], "out_col": OUT_COL, "out_size": OUT_SIZE}
    for name, make in change.items():
        args[name] = make(args)
    with pytest.raises(RuntimeError, match="lora_bgmv"):
        module.lora_bgmv(**args)


def _with(name: str, row: int, value: int):
    def make(args):
        changed = args[name].clone()
        changed[row] = value
        if name != "ranks":
            args["ranks"] = args["ranks"].clone().fill_(16)  # every row reads its adapter
        return changed
    return make


@pytest.mark.parametrize("change", [
    {"a_offsets": _with("a_offsets", 2, -1)},
    {"a_offsets": lambda a: a["a_offsets"] + a["a_pool"].numel() - 16 * IN_FEATURES + 1,
     "ranks": lambda a: torch.full_like(a["ranks"], 16)},
    {"b_offsets": _with("b_offsets", 1, 10 ** 9)},
    {"ranks": _with("ranks", 3, 65)},
    {"ranks": _with("ranks", 0, -1)},
    {"x": lambda a: a["x"].double()},
    {"a_pool": lambda a: a["a_pool"].bfloat16()},
    {"b_pool": lambda a: a["b_pool"].half()},
    {"out": lambda a: a["out"].bfloat16()},
    {"ranks": lambda a: a["ranks"].int()},
    {"a_offsets": lambda a: a["a_offsets"][:3]},
    {"out_col": lambda a: OUT_WIDTH - OUT_SIZE + 1},
    {"out": lambda a: a["out"].t().contiguous().t()},  # column stride != 1
    {"x": lambda a: a["x"].t().contiguous().t()},
    {"out": lambda a: a["out"][:3]},
], ids=["a_offset_negative", "a_extent_past_pool", "b_offset_past_pool", "rank_over_64", "rank_negative",
        "x_fp64", "a_pool_bf16", "b_pool_fp16", "out_bf16", "ranks_int32", "offsets_short", "columns_past_out",
        "out_column_strided", "x_column_strided", "out_rows_short"])
def test_refusals_raise(change) -> None:
    _refused(kernels(), **change)
