"""Micro-benchmark of the packed GGUF kernels on one thread, random blocks, best of 5 calls:

- the grouped expert kernel (and the per-expert loop) over one layer of Qwen3-30B-A3B's experts
  (hidden 2048, 128 experts, 8 active, expert width 768), at 1, 8 and 32 tokens;
- the dense packed matmul over SmolLM2-1.7B's MLP projections (gate|up 2 x 8192 x 2048, down
  2048 x 8192; the smaller SmolLM2 widths are not whole 256-weight K blocks), at 1 and 8 rows.

    python scripts/packed_kernel_bench.py [--kernels OTHER_BUILD.so] [--types Q4_K Q5_K Q6_K]

``--kernels`` times another build of the C++ kernels (say, a checkout's before a change) in
this process. Prints markdown rows: ms per call and G weights read per second (each distinct
weight the call multiplies counted once).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.bench.kernels import best_time_s
from pagedllm.kernels import cpu
from pagedllm.model.layers import GATED_ACTIVATIONS
from pagedllm.model.moe import grouped
from pagedllm.model.moe.packed_experts import PackedExperts, PackedExpertWeight

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
DENSE_SHAPES = {"gate|up": (2 * 8192, 2048), "down": (2048, 8192)}
# Byte offsets of each type's fp16 scale fields: set to 0.01 so every weight is a moderate number.
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: GGMLQuantizationType, stacks: int, rows: int, columns: int) -> torch.Tensor:
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (stacks * rows * columns // block_size, block_bytes), dtype=torch.uint8,
                           generator=generator)
    for offset in SCALE_OFFSETS[qtype.name]:
        blocks[:, offset:offset + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    return blocks.reshape(stacks, rows, -1)


def load_other_build(path: str) -> None:
    """Make every caller of the C++ kernels use the extension at ``path``."""
    loader = importlib.machinery.ExtensionFileLoader(cpu._MODULE_NAME, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(cpu._MODULE_NAME, loader))
    loader.exec_module(module)
    cpu.load_cpu_kernels = lambda: module


def expert_rows(qtype: GGMLQuantizationType) -> list[str]:
    experts = PackedExperts(
        [PackedExpertWeight(random_blocks(qtype, EXPERTS, 2 * WIDTH, HIDDEN), qtype, (EXPERTS, 2 * WIDTH, HIDDEN),
                            torch.float32)],
        PackedExpertWeight(random_blocks(qtype, EXPERTS, HIDDEN, WIDTH), qtype, (EXPERTS, HIDDEN, WIDTH),
                           torch.float32),
        GATED_ACTIVATIONS["silu"])
    rows = []
    for tokens in (1, 8, 32):
        generator = torch.Generator().manual_seed(tokens)
        indices = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
        weights = torch.full((tokens, TOP_K), 1.0 / TOP_K)
        x = torch.randn(tokens, HIDDEN, generator=generator)
        read = indices.unique().numel() * 3 * WIDTH * HIDDEN
        grouped_s = best_time_s(lambda: experts(x, indices, weights), 5)
        loop_s = best_time_s(
            lambda: grouped.loop_forward(x, indices, weights, EXPERTS, experts.expert_forward), 5)
        rows.append(f"| {qtype.name} | experts | {tokens} | {grouped_s * 1e3:.2f} | {read / grouped_s / 1e9:.2f} "
                    f"| {loop_s * 1e3:.2f} |")
    return rows


def dense_rows(qtype: GGMLQuantizationType) -> list[str]:
    kernels = cpu.load_cpu_kernels()
    rows = []
    for name, (out_features, in_features) in DENSE_SHAPES.items():
        blocks = random_blocks(qtype, 1, out_features, in_features)[0]
        for tokens in (1, 8):
            x = torch.randn(tokens, in_features)
            out = torch.empty(tokens, out_features)
            seconds = best_time_s(lambda: kernels.quant_linear(x, blocks, int(qtype), out, 48, True), 5)
            rows.append(f"| {qtype.name} | {name} | {tokens} | {seconds * 1e3:.2f} "
                        f"| {out_features * in_features / seconds / 1e9:.2f} | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="another build's pagedllm_cpu_kernels .so to time")
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K"], choices=sorted(SCALE_OFFSETS))
    args = parser.parse_args()
    if args.kernels:
        load_other_build(args.kernels)
    torch.set_num_threads(1)
    print("| type | shape | tokens | ms (grouped / matmul) | G weights/s | ms (per-expert loop) |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name in args.types:
            qtype = GGMLQuantizationType[name]
            for row in expert_rows(qtype) + dense_rows(qtype):
                print(row, flush=True)


if __name__ == "__main__":
    main()
