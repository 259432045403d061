"""`pagedllm bench hybrid-kv`: what the hybrid KV cache manager saves on a model that mixes
full-attention and sliding-window layers (Gemma 3: 5 local layers of every 6), against the same
engine with ``disable_hybrid_kv_cache_manager``, and what it costs a full-attention model.

Three measurements, each with the manager on and off in the same run:

- **KV bytes held per sequence** at each length N: one request of N - 1 random prompt tokens and
  one output token (so a model's whole context fits) alone in the pool; its peak blocks in use
  (``stats()["peak_blocks_in_use"]``, which includes the chunk a sliding layer holds beyond its window while prefilling) times the pool's
  bytes per block (the KV budget over the blocks it made). Lengths past ``measure_up_to`` are not
  run (on a CPU a 32k prefill takes long): their row gives the layout's arithmetic
  (``KVGroupLayout.blocks_held``, the blocks kept once the window has moved on), marked as such.
- **Concurrent sequences** of ``concurrent_len`` tokens in a fixed KV budget: ``num_seqs``
  requests submitted at once; the most that ran in one step (``peak_running_per_step``).
- **w1 throughput** (the throughput bench's mixed workload) on a full-attention model, where the
  manager must cost nothing: one group either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm import LLM, SamplingParams
from pagedllm.bench import llama_server_kv
from pagedllm.bench.tables import markdown_table
from pagedllm.bench.throughput import BenchResult, random_requests
from pagedllm.kv_layouts import blocks_held

MODES = (("hybrid", False), ("no hybrid", True))  # label, disable_hybrid_kv_cache_manager


@dataclass
class HeldRow:
    tokens: int
    bytes_held: dict[str, int]  # mode label -> bytes one sequence holds
    measured: bool


@dataclass
class PoolFacts:
    """What one engine's pool is: its block size and bytes, and the layout of its groups."""

    block_size: int
    bytes_per_block: float
    groups: str
    blocks_held: Callable[[int], int]  # the layout's arithmetic: blocks a sequence of N tokens keeps


def pool_facts(llm: LLM, kv_budget: int) -> PoolFacts:
    stats, groups = llm.stats(), llm.kv_pool_snapshot()["kv_groups"]
    block_size = stats["block_size"]
    describe = "one group" if len(groups) == 1 else f"{len(groups)} groups: " + ", ".join(map(_group_text, groups))
    return PoolFacts(block_size, kv_budget / stats["num_blocks"], describe,
                     lambda n: blocks_held(groups, n, block_size))


def _group_text(group: dict) -> str:
    kind = f"window {group['window']}" if group["window"] is not None else (
        f"chunk {group['chunk']}" if group.get("chunk") is not None else "full")
    return f"{len(group['layers'])} layers {kind}"


def bytes_held(make: Callable[[bool], LLM], lengths: list[int], measure_up_to: int,
               kv_budget: int) -> tuple[list[HeldRow], dict[str, str]]:
    """Per length, the bytes one sequence holds with the manager on and off; and each mode's groups."""
    rows = [HeldRow(n, {}, n <= measure_up_to) for n in lengths]
    groups: dict[str, str] = {}
    for label, disable in MODES:
        llm = make(disable)
        facts = pool_facts(llm, kv_budget)
        groups[label] = facts.groups
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for row in rows:
            if row.measured:
                llm.reset_peak_blocks_in_use()
                # N tokens in all: N - 1 of prompt and the one generated (a model's whole context fits).
                (prompt,) = random_requests(1, row.tokens - 1, 1, llm.llm_engine.vocab_size, seed=row.tokens)
                llm.generate([{"prompt_token_ids": prompt.prompt_token_ids}], params, use_tqdm=False)
                blocks = llm.stats()["peak_blocks_in_use"]
                llm.reset_prefix_cache()
            else:
                blocks = facts.blocks_held(row.tokens)
            row.bytes_held[label] = round(blocks * facts.bytes_per_block)
        llm.shutdown()
    return rows, groups


def concurrent_sequences(make: Callable[[bool], LLM], num_seqs: int, tokens: int, output_len: int) -> dict[str, int]:
    """Per mode, the most ``tokens``-token sequences that ran in one step (``num_seqs`` submitted)."""
    peaks = {}
    for label, disable in MODES:
        llm = make(disable)
        requests = random_requests(num_seqs, tokens, output_len, llm.llm_engine.vocab_size, seed=1)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
        peaks[label] = llm.stats()["peak_running_per_step"]
        llm.shutdown()
    return peaks


@dataclass
class LlamaColumns:
    """llama.cpp's figures beside the engine's, or only the note why there are none."""

    note: str
    held: dict[int, dict[str, int]] = field(default_factory=dict)  # tokens -> mode label -> bytes
    slots: dict[str, int] = field(default_factory=dict)  # mode label -> most sequences in the budget


def llama_columns(path: str | None, model: str, cache_type: str, lengths: list[int], tokens: int,
                  budget: int) -> LlamaColumns:
    """Run ``llama-server`` (``path``, else the PATH's) on the same GGUF: the KV bytes of one
    sequence at each length and the most ``tokens``-token slots whose KV fits in ``budget``."""
    binary = llama_server_kv.find_llama_server(path)
    if binary is None:
        return LlamaColumns("llama.cpp: no `llama-server` on this machine (PATH or --llama-server), so no llama.cpp "
                            "column.")
    if not model.endswith(".gguf"):
        return LlamaColumns(f"llama.cpp: `{binary}` found, but the model is not a GGUF file, so no llama.cpp column.")
    server = llama_server_kv.LlamaServer(binary, model, cache_type)
    held = llama_server_kv.bytes_per_sequence(server, sorted({*lengths, tokens}))
    slots = llama_server_kv.most_sequences(server, tokens, budget, held[tokens])
    return LlamaColumns(
        f"llama.cpp: `{binary}` on the same GGUF, KV cache type {cache_type}, the bytes it logs allocating "
        f"(`llama_kv_cache: size = ...`) with its SWA cache and with `--swa-full`, no request run: per sequence "
        f"`-c N -np 1`; at once, the largest P whose `-c {tokens}*P -np P --kv-unified` cache fits the KV budget, "
        "found by starting it.", held, slots)


def format_held(rows: list[HeldRow], measure_up_to: int, llama: LlamaColumns) -> str:
    table = []
    labels = [label for label, _ in llama_server_kv.MODES] if llama.held else []
    for row in rows:
        on, off = row.bytes_held["hybrid"], row.bytes_held["no hybrid"]
        how = "measured (peak during prefill)" if row.measured else f"layout arithmetic (> {measure_up_to} not run)"
        theirs = [f"{llama.held[row.tokens][label] / 2**20:.1f}" for label in labels]
        table.append([row.tokens, f"{on / 2**20:.1f}", f"{off / 2**20:.1f}", f"{on / off:.2f}x", *theirs, how])
    return markdown_table(["tokens", "hybrid (MiB)", "no hybrid (MiB)", "hybrid / no hybrid",
                           *(f"{label} (MiB)" for label in labels), "how"], table)


def format_concurrency(peaks: dict[str, int], num_seqs: int, tokens: int, kv_budget: int,
                       llama: LlamaColumns) -> str:
    on, off = peaks["hybrid"], peaks["no hybrid"]
    return markdown_table(
        ["sequence length", "KV budget (MiB)", "submitted", "hybrid: most at once", "no hybrid: most at once",
         "hybrid / no hybrid", *(f"{label}: most slots that fit" for label in llama.slots)],
        [[tokens, f"{kv_budget / 2**20:.0f}", num_seqs, on, off, f"{on / off:.2f}x" if off else "-",
          *llama.slots.values()]])


def format_throughput(results: dict[str, BenchResult]) -> str:
    off = results["no hybrid"]
    return markdown_table(
        ["w1 (full-attention model)", "time (s)", "total tok/s", "vs no hybrid"],
        [[label, f"{r.elapsed_s:.2f}", f"{r.total_tokens_per_s:.1f}",
          f"{r.total_tokens_per_s / off.total_tokens_per_s:.3f}x"] for label, r in results.items()])
