"""`pagedllm bench attention`, `bench linear` and `bench roofline`: the kernels against the machine.

attention: paged decode (the C++ kernel, and the PyTorch gather path) against
contiguous ``scaled_dot_product_attention`` on the same shapes; with ``--prefill``,
causal prefill attention: the C++ bf16 kernel against SDPA in bf16 and fp32.
linear: one decode step's fp32 projections, the C++ small-batch kernel against
PyTorch's (MKL) matmul, per batch size.
roofline: matmul throughput on the model's own projection shapes, the decode
rate it allows, and the engine's decode steps at the same batch, interleaved
(``--dataset mixed``: a whole workload's steps against the roofline, ``phases``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm import SamplingParams
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.selector import cpu_decode, cpu_prefill
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.model.packed_linear import pack_weight, packing_supported
from pagedllm.model.shapes import num_kv_heads_of
from pagedllm.bench.tables import markdown_table


def best_time_s(fn: Callable[[], object], repeats: int) -> float:
    """Best-of-``repeats`` seconds of one call (after a warm-up): the least noisy figure."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def attention_rows(batches: list[int], contexts: list[int], num_heads: int = 9, num_kv_heads: int = 3,
                   head_dim: int = 64, block_size: int = 16, repeats: int = 5) -> list[dict]:
    """Per (batch, context): ms per decode call for each implementation."""
    kernel = load_cpu_kernels()
    rows = []
    for batch in batches:
        for context in contexts:
            blocks_per_seq = -(-context // block_size)
            num_blocks = batch * blocks_per_seq
            key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
            value_cache = torch.randn_like(key_cache)
            tables = torch.randperm(num_blocks).view(batch, blocks_per_seq)  # scattered, as in a real pool
            query = torch.randn(batch, num_heads, head_dim)
            empty = torch.zeros(0, num_kv_heads, head_dim)
            metadata = AttentionMetadata(torch.zeros(0, dtype=torch.long), batch, tables,
                                         torch.full((batch,), context), [])
            keys = torch.randn(batch, num_kv_heads, context, head_dim)
            values = torch.randn_like(keys)
            row = {"batch": batch, "context": context}
            row["contiguous_sdpa_ms"] = 1e3 * best_time_s(lambda: F.scaled_dot_product_attention(
                query.unsqueeze(2), keys, values, enable_gqa=True), repeats)
            pool = LayerKVCache(key_cache, value_cache)
            for name, backend in (("paged_cpp_ms", TorchPagedAttention(cpu_decode) if kernel else None),
                                  ("paged_pytorch_ms", TorchPagedAttention())):
                if backend is not None:
                    row[name] = 1e3 * best_time_s(lambda: backend.forward(
                        query, empty, empty, pool, metadata, head_dim**-0.5), repeats)
            rows.append(row)
    return rows


def format_attention(rows: list[dict]) -> str:
    return markdown_table(
        ["batch", "context", "contiguous SDPA (ms)", "paged C++ (ms)", "paged PyTorch (ms)", "C++ / SDPA"],
        [[r["batch"], r["context"], _figure(r["contiguous_sdpa_ms"]), _figure(r.get("paged_cpp_ms")),
          _figure(r["paged_pytorch_ms"]), _ratio(r.get("paged_cpp_ms"), r["contiguous_sdpa_ms"])] for r in rows])


def _figure(milliseconds: float | None, spec: str = ".3f") -> str:
    """A time, or "-" where it was not measured (the C++ kernels did not build)."""
    return "-" if milliseconds is None else f"{milliseconds:{spec}}"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return "-" if numerator is None or denominator is None else f"{numerator / denominator:.2f}x"


@torch.inference_mode()
def prefill_attention_rows(lengths: list[int], num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
                           repeats: int = 5) -> list[dict]:
    """Per prompt length: ms per causal prefill attention call of one layer, PyTorch's SDPA
    in fp32 and bf16 and the C++ bf16 kernel (when it built)."""
    kernel = load_cpu_kernels()
    rows = []
    for length in lengths:
        query = torch.randn(length, num_heads, head_dim)
        key, value = torch.randn(length, num_kv_heads, head_dim), torch.randn(length, num_kv_heads, head_dim)
        row = {"length": length}
        for dtype, name in ((torch.float32, "sdpa_fp32_ms"), (torch.bfloat16, "sdpa_bf16_ms")):
            q, k, v = (t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            row[name] = 1e3 * best_time_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                    repeats)
        if kernel is not None:
            q, k, v = (t.bfloat16() for t in (query, key, value))
            row["cpp_bf16_ms"] = 1e3 * best_time_s(lambda: cpu_prefill(q, k, v, head_dim**-0.5, 0), repeats)
        rows.append(row)
    return rows


def format_prefill_attention(rows: list[dict]) -> str:
    return markdown_table(
        ["prompt tokens", "SDPA fp32 (ms)", "SDPA bf16 (ms)", "C++ bf16 (ms)", "C++ vs SDPA bf16",
         "C++ bf16 vs SDPA fp32"],
        [[r["length"], _figure(r["sdpa_fp32_ms"]), _figure(r["sdpa_bf16_ms"]), _figure(r.get("cpp_bf16_ms")),
          _ratio(r["sdpa_bf16_ms"], r.get("cpp_bf16_ms")), _ratio(r["sdpa_fp32_ms"], r.get("cpp_bf16_ms"))]
         for r in rows])


@torch.inference_mode()
def linear_rows(config, batches: list[int], repeats: int = 8, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Per batch size: ms for every projection of one decode step in ``dtype``
    (fp32 or bf16; each layer with its own weights, streamed from memory as in
    the engine), through PyTorch's matmul (MKL / oneDNN), through the C++
    small-batch kernel and, where the engine packs its weights of ``dtype``
    (``packed_linear``), through the packed kernel; interleaved so all
    see the same machine load."""
    kernel = load_cpu_kernels()
    weights = [(fan_in, torch.randn(fan_out, fan_in, dtype=dtype))
               for fan_in, fan_out, count in projection_shapes(config) for _ in range(count)]
    packed = ([(fan_in, pack_weight(w)) for fan_in, w in weights]
              if packing_supported(torch.device("cpu"), dtype) else None)
    rows = []
    for batch in batches:
        inputs = {fan_in: torch.randn(batch, fan_in, dtype=dtype) for fan_in, _ in weights}
        passes = {"pytorch_ms": lambda: [F.linear(inputs[k], w) for k, w in weights]}
        if kernel is not None:
            passes["small_batch_ms"] = lambda: [kernel.linear_small_batch(inputs[k], w) for k, w in weights]
        if packed is not None:
            passes["packed_ms"] = lambda: [kernel.packed_linear(inputs[k], w) for k, w in packed]
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(repeats):
            for name, one_pass in passes.items():
                best[name] = min(best[name], _time_once(one_pass))
        rows.append({"batch": batch, **{name: 1e3 * seconds for name, seconds in best.items()}})
    return rows


def format_linear(rows: list[dict]) -> str:
    packed = any("packed_ms" in r for r in rows)
    header = ["rows", "PyTorch (ms)", "C++ small-batch (ms)", "speed-up"]
    if packed:
        header += ["C++ packed (ms)", "packed vs PyTorch", "packed vs small-batch"]
    table = []
    for r in rows:
        small = r.get("small_batch_ms")
        table.append([r["batch"], _figure(r["pytorch_ms"], ".1f"), _figure(small, ".1f"),
                      _ratio(r["pytorch_ms"], small)])
        if packed:
            table[-1] += [_figure(r["packed_ms"], ".1f"), _ratio(r["pytorch_ms"], r["packed_ms"]),
                          _ratio(small, r["packed_ms"])]
    return markdown_table(header, table)


def projection_shapes(config) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matmul one decoded token goes through."""
    heads, kv_heads = config.num_attention_heads, num_kv_heads_of(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    return [
        (hidden, (heads + 2 * kv_heads) * head_dim, layers),
        (heads * head_dim, hidden, layers),
        (hidden, 2 * inter, layers),
        (inter, hidden, layers),
        (hidden, config.vocab_size, 1),
    ]


@dataclass
class RooflineResult:
    gflops: float  # best matmul pass over the model's shapes
    bound_tokens_per_s: float  # rows / best pass time
    best_decode_tokens_per_s: float  # rows / best engine decode step
    median_decode_tokens_per_s: float  # rows / median engine decode step


class ModelMatmuls:
    """Every projection one token goes through, each layer with weights of its own
    (so they stream from memory as in a real step instead of sitting hot in the
    cache, which would overstate the bound), run at any number of rows: the
    floor a step's linear layers cannot beat on this machine."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        shapes = projection_shapes(config)
        self.dtype = dtype
        self.layers = [torch.randn(fan_out, fan_in, dtype=dtype)
                       for fan_in, fan_out, count in shapes[:-1] for _ in range(count)]
        self.head = torch.randn(shapes[-1][1], shapes[-1][0], dtype=dtype)  # the vocabulary projection
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}  # by (rows, fan_in), made once

    def _input(self, rows: int, fan_in: int) -> torch.Tensor:
        if (rows, fan_in) not in self._inputs:
            self._inputs[rows, fan_in] = torch.randn(rows, fan_in, dtype=self.dtype)
        return self._inputs[rows, fan_in]

    def run(self, rows: int, head_rows: int) -> None:
        """One pass: ``rows`` tokens through every layer, ``head_rows`` of them
        (the sampled ones) through the vocabulary projection."""
        for weight in self.layers:
            F.linear(self._input(rows, weight.shape[1]), weight)
        if head_rows:
            F.linear(self._input(head_rows, self.head.shape[1]), self.head)

    def flops(self, rows: int, head_rows: int) -> float:
        return 2.0 * (rows * sum(w.numel() for w in self.layers) + head_rows * self.head.numel())

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (*self.layers, self.head))

    def read_all(self) -> None:
        """Read every weight once (a reduction per tensor): the memory side of a step's floor."""
        for weight in (*self.layers, self.head):
            weight.sum()


def read_bandwidth_gbps(matmuls: ModelMatmuls, repeats: int = 3) -> float:
    """GB/s of reading every weight of ``matmuls`` once, best of ``repeats``: the machine's
    memory bandwidth as a decode step sees it (the roofline's memory side)."""
    return matmuls.weight_bytes / best_time_s(matmuls.read_all, repeats) / 1e9


def _time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def roofline_vs_decode(engine, rows: int, prompts: list[list[int]], decode_steps: int,
                       dtype: torch.dtype) -> RooflineResult:
    """Interleave, ``decode_steps`` times, one matmul pass and one engine decode
    step of ``rows`` sequences, and compare the best of each: the two sides then
    see the same machine load (on a shared machine a long measurement rarely
    gets a quiet window, a short one often does)."""
    matmuls = ModelMatmuls(engine.model_config, dtype)
    flops = matmuls.flops(rows, rows)

    def one_pass() -> None:
        matmuls.run(rows, rows)

    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 2, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"roofline-{i}", {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill until every sequence has its first token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    one_pass()
    pass_times, step_times = [], []
    for _ in range(decode_steps):
        pass_times.append(_time_once(one_pass))
        step_times.append(_time_once(engine.step))
    while engine.has_unfinished_requests():
        engine.step()
    best_pass = min(pass_times)
    return RooflineResult(
        gflops=flops / best_pass / 1e9,
        bound_tokens_per_s=rows / best_pass,
        best_decode_tokens_per_s=rows / min(step_times),
        median_decode_tokens_per_s=rows / statistics.median(step_times),
    )
