"""`pagedllm bench moe`: decode speed of a mixture of experts with packed Q4_K experts.

The model (``moe_gguf``) has Qwen3-30B-A3B's layer shapes and random weights, a few layers
deep. At each batch size, three decoders run on the same file, one after the other, so the
row's figures see the same machine load (``--rounds`` repeats the whole sweep and keeps each
figure's best):

  grouped: pagedllm with its grouped expert kernel (one C++ call per projection per layer);
  loop: pagedllm with ``PAGEDLLM_MOE_GROUPED=0``, the per-expert loop (each expert's
        projections through the packed single-matrix kernel);
  llama.cpp: ``llama-batched-bench`` (``moe_llama``), where a build is found.

Each pagedllm run is its own process (a fresh engine, the switch set before it starts). Its
decode rate is the tokens generated after every sequence has its first token over the time
those steps took: prefill is left out, as llama-batched-bench's ``S_TG`` leaves it out.

Batch 1's roofline is the rate of reading, once per token, every byte a token needs: the
active experts' share of each expert stack, every dense tensor, one embedding row
(``moe_gguf.bytes_per_token``), at the bandwidth `pagedllm bench roofline` measures
(``kernels.read_bandwidth_gbps``: every weight of a model-shaped set read once, best of 3),
measured in the same run.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from pagedllm.bench.moe_gguf import MoeShape, bytes_per_token, roofline_tokens_per_s
from pagedllm.bench.moe_llama import llama_decode_rate
from pagedllm.bench.tables import markdown_table

MODES = ("grouped", "loop", "llama.cpp")


@dataclass
class MoeRow:
    batch: int
    rates: dict[str, float] = field(default_factory=dict)  # decode tok/s by mode (best of the rounds)
    load: list[float] = field(default_factory=list)  # 1-minute load average before each of its runs

    def keep(self, mode: str, rate: float) -> None:
        self.rates[mode] = max(rate, self.rates.get(mode, 0.0))


@dataclass
class MoeResult:
    shape: MoeShape
    rows: list[MoeRow]
    bandwidth_gbps: float
    threads: int

    @property
    def roofline_tokens_per_s(self) -> float:
        return roofline_tokens_per_s(self.shape, self.bandwidth_gbps)


def decode_rate(path: str, grouped: bool, batch: int, prompt_len: int, output_len: int, threads: int,
                seed: int = 0) -> float:
    """In a child process: pagedllm's decode tokens/s of ``batch`` sequences on ``path``, with
    the grouped kernel or (``grouped=False``) the per-expert loop."""
    import numpy as np

    os.environ["PAGEDLLM_MOE_GROUPED"] = "1" if grouped else "0"
    from pagedllm import LLM

    blocks_per_seq = -(-(prompt_len + output_len) // 16) + 1
    llm = LLM(path, max_model_len=prompt_len + output_len + 16, num_kv_blocks=batch * blocks_per_seq + 4,
              enable_prefix_caching=False, num_threads=threads)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, llm.llm_engine.vocab_size, prompt_len).tolist() for _ in range(batch)]
    try:
        return timed_decode(llm, prompts, output_len)
    finally:
        llm.shutdown()


def timed_decode(llm, prompts: list[list[int]], output_len: int) -> float:
    """Decode tokens/s of ``prompts`` run together to ``output_len`` tokens each, EOS ignored,
    after a 2-token warm-up request: the tokens generated once every sequence has its first
    one over the time those steps took."""
    from pagedllm import SamplingParams

    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"moe-{i}", {"prompt_token_ids": prompt}, params)
    generated: dict[str, int] = {}

    def step() -> None:
        generated.update((o.request_id, len(o.outputs[0].token_ids)) for o in engine.step() if o.outputs[0].token_ids)

    while len(generated) < len(prompts):  # prefill, until every sequence has its first token
        step()
    first = sum(generated.values())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step()
    return (sum(generated.values()) - first) / (time.perf_counter() - start)


def _pagedllm_rate(path: Path, grouped: bool, batch: int, prompt_len: int, output_len: int, threads: int) -> float:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(decode_rate, (str(path), grouped, batch, prompt_len, output_len, threads))


def load_average() -> float:
    """The 1-minute load average (the bench notes it beside every row: the machine may be shared)."""
    return os.getloadavg()[0]


def run(path: Path, shape: MoeShape, batches: list[int], prompt_len: int, output_len: int, threads: int,
        llama_binary: str | None, rounds: int = 1) -> MoeResult:
    """Every batch size's three decoders, interleaved, ``rounds`` times; then the bandwidth."""
    rows = [MoeRow(batch) for batch in batches]
    for _ in range(rounds):
        for row in rows:
            for mode in MODES:
                if mode == "llama.cpp" and llama_binary is None:
                    continue
                row.load.append(load_average())
                if mode == "llama.cpp":
                    rate = llama_decode_rate(llama_binary, path, row.batch, prompt_len, output_len, threads)
                else:
                    rate = _pagedllm_rate(path, mode == "grouped", row.batch, prompt_len, output_len, threads)
                print(f"batch {row.batch} {mode}: {rate:.2f} tok/s (load {row.load[-1]:.1f})", flush=True)
                row.keep(mode, rate)
    return MoeResult(shape, rows, measure_bandwidth(shape, threads), threads)


def measure_bandwidth(shape: MoeShape, threads: int) -> float:
    """GB/s of reading every weight of a model-shaped fp32 set once (`bench roofline`'s
    measure), its MLP as wide as the active experts together."""
    import torch

    from pagedllm.bench.kernels import ModelMatmuls, read_bandwidth_gbps

    config = SimpleNamespace(num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                             head_dim=shape.head_dim, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                             intermediate_size=shape.active * shape.expert_width, vocab_size=shape.vocab)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return read_bandwidth_gbps(ModelMatmuls(config, torch.float32))
    finally:
        torch.set_num_threads(previous)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _times(numerator: float | None, denominator: float | None) -> str:
    return "-" if numerator is None or not denominator else f"{numerator / denominator:.2f}x"


def format_table(result: MoeResult) -> str:
    """One row per batch size: the three decode rates, the grouped kernel's ratios, and batch
    1's share of the roofline."""
    roof = result.roofline_tokens_per_s
    table = []
    for row in result.rows:
        grouped, loop, llama = (row.rates.get(mode) for mode in MODES)
        share = f"{100 * grouped / roof:.0f}% of {roof:.1f}" if row.batch == 1 and grouped else "-"
        table.append([row.batch, _rate(grouped), _rate(loop), _rate(llama), _times(grouped, llama),
                      _times(grouped, loop), share, " / ".join(f"{load:.1f}" for load in row.load)])
    return markdown_table(["batch", "grouped tok/s", "loop tok/s", "llama.cpp tok/s", "grouped / llama.cpp",
                           "grouped / loop", "batch 1 of roofline tok/s", "load avg before each run"], table)


def describe(result: MoeResult, prompt_len: int, output_len: int, rounds: int) -> str:
    """The record's setup line: the model, the types, the workload and the roofline's terms."""
    shape = result.shape
    return (f"Random qwen3moe GGUF of Qwen3-30B-A3B's layer shapes, {shape.layers} layers (hidden {shape.hidden}, "
            f"{shape.experts} experts, {shape.active} active, expert width {shape.expert_width}, "
            f"{shape.heads}/{shape.kv_heads} heads of {shape.head_dim}, vocabulary {shape.vocab}): experts Q4_K, "
            f"attention, embedding and LM head Q8_0, routers and norms F32. Decode tok/s after prefill, "
            f"{prompt_len}-token random prompts, {output_len} new tokens each (ignore_eos), {result.threads} threads; "
            f"best of {rounds} interleaved round(s). Roofline: {bytes_per_token(shape) / 2**20:.1f} MiB read per "
            f"token (active experts, dense tensors, one embedding row) at {result.bandwidth_gbps:.1f} GB/s "
            f"(`bench roofline`'s read of every weight once, measured after the rows).")
