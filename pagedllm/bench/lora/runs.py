"""The LoRA bench's workload and measurements: one timed run per engine, and the cost of
one page-in on an idle engine.

Every run times the same requests (greedy, ``ignore_eos``, one ``LLM.generate`` call)
through ``throughput.run_pagedllm``. Before the clock starts, a LoRA engine runs one
short request under a spare adapter (so the LoRA path's one-time costs stay out) and
registers every adapter of the run (``AdapterRegistry.spec_for`` reads and checks an
adapter once per name, a one-time cost per name, not per page-in). Page-ins and their
seconds are the scheduler's and the runner's counters, read around the timed call.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.bench.fleet.workload import grow_text, sentence, tokenizer_counter
from pagedllm.bench.throughput import BenchRequest, BenchResult, run_pagedllm
from pagedllm.lora.page_layout import adapter_layout, projection_shapes

# Prompt lengths (tokens), log-uniform: mostly short questions, a few long passages.
PROMPT_TOKENS = (32, 256)
# Names of the spare adapters: the warm-up's and the page-in probe's (own pages, never in a timed run).
WARM_NAME, PROBE_NAME = "bench-warm-up", "bench-probe"


@dataclass
class LoRARun:
    """One engine's timed run: ``num_adapters`` None for the base model."""

    label: str
    num_adapters: int | None
    adapters_used: int
    num_blocks: int
    result: BenchResult
    page_ins: int = 0
    page_in_seconds: float = 0.0
    peak_running: int = 0
    step_timings: dict[str, float] = field(default_factory=dict)

    @property
    def mean_page_in_ms(self) -> float | None:
        return 1000 * self.page_in_seconds / self.page_ins if self.page_ins else None


@dataclass
class PageInCost:
    """One page-in on an idle engine (median of a few): reading the adapter from disk (fp32
    tensors) and the whole load (read + write into its pages), and what it occupies."""

    read_ms: float
    load_ms: float
    file_mb: float
    num_pages: int
    pool_mib: float


def real_text_requests(tokenizer: Any, num: int, max_tokens: int, seed: int = 0) -> list[BenchRequest]:
    """``num`` English-looking passages (the fleet bench's sentences), log-uniform in
    ``PROMPT_TOKENS`` tokens, as token ids: every engine gets exactly the same prompts."""
    rng = random.Random(seed)
    count = tokenizer_counter(tokenizer)
    low, high = PROMPT_TOKENS
    requests = []
    for _ in range(num):
        target = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        text = grow_text(sentence(rng), rng, count, target)
        requests.append(BenchRequest(tokenizer.encode(text, add_special_tokens=False), max_tokens))
    return requests


def blocks_for(requests: list[BenchRequest], block_size: int) -> int:
    """KV blocks that hold every request at its longest at once (so a pool this size never
    makes one wait), plus one block of slack per request."""
    return sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / block_size) + 1 for r in requests)


def pages_per_adapter(llm: LLM, rank: int, targets: tuple[str, ...]) -> int:
    """Blocks one rank-``rank`` adapter on ``targets`` takes in ``llm``'s pool (the layout the
    LoRA engines use: same model, same block size and dtype)."""
    page_elems = llm.stats()["lora_page_elems"]
    num_groups = len(llm.kv_pool_snapshot()["kv_groups"])
    return adapter_layout(rank, targets, projection_shapes(llm.llm_engine.model_config), page_elems,
                          num_groups).num_blocks


def lora_requests(paths: list[str], num_adapters: int, num_requests: int) -> list[LoRARequest]:
    """Request i runs adapter i mod N (round-robin: uniform over the adapters)."""
    return [LoRARequest(f"adapter-{i % num_adapters:03d}", i % num_adapters + 1, paths[i % num_adapters])
            for i in range(num_requests)]


def timed_run(llm: LLM, label: str, requests: list[BenchRequest], loras: list[LoRARequest] | None,
              warm_path: str | None = None, num_adapters: int | None = None) -> LoRARun:
    """Time ``requests`` on ``llm`` (``loras``: one per request, None for the base run) and
    check that the pool is all free afterwards."""
    engine = llm.llm_engine
    if loras is not None:
        _warm_lora_path(llm, warm_path, len(requests) + 1)
        for lora in {lora.lora_name: lora for lora in loras}.values():
            engine.adapter_registry.spec_for(lora)
    before = llm.stats()
    result = run_pagedllm(llm, requests, label, lora_request=loras)
    stats = check_pool_free(llm, label)
    return LoRARun(label, num_adapters, len({lora.lora_name for lora in loras or []}), stats["num_blocks"], result,
                   page_ins=stats.get("lora_page_ins", 0) - before.get("lora_page_ins", 0),
                   page_in_seconds=stats.get("lora_load_seconds", 0.0) - before.get("lora_load_seconds", 0.0),
                   peak_running=stats["peak_running_per_step"], step_timings=llm.step_timings())


def _warm_lora_path(llm: LLM, path: str, lora_id: int) -> None:
    """One short request under a spare adapter: the LoRA path's one-time costs leave the
    timed run. Its pages are then idle and evicted like any cached block when needed."""
    llm.generate([{"prompt_token_ids": [0] * 8}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False, lora_request=LoRARequest(WARM_NAME, lora_id, path))


def check_pool_free(llm: LLM, label: str) -> dict:
    """``llm.stats()``, after checking that every block is back in the pool (idle adapters'
    pages and cached prefix blocks count as free): a leak is an error, not a figure."""
    stats = llm.stats()
    if stats["num_free_blocks"] != stats["num_blocks"]:
        raise RuntimeError(f"{label}: {stats['num_blocks'] - stats['num_free_blocks']} of {stats['num_blocks']} "
                           "KV blocks are still in use after the run")
    return stats


def page_in_cost(llm: LLM, paths: list[str], first_id: int) -> PageInCost:
    """Page in each adapter of ``paths`` alone (one 1-token request each, under a name no
    run uses, so nothing is resident) on the idle LoRA engine ``llm``; medians over them."""
    from pagedllm.lora.adapter_files import read_adapter

    from pagedllm.bench.lora.adapters import folder_megabytes

    engine = llm.llm_engine
    reads, loads, pages = [], [], 0
    for index, path in enumerate(paths):
        lora = LoRARequest(f"{PROBE_NAME}-{index}", first_id + index, path)
        pages = engine.adapter_registry.spec_for(lora).num_pages
        start = time.perf_counter()
        read_adapter(path, engine.model_config, engine.config.lora.max_lora_rank)
        reads.append(time.perf_counter() - start)
        before = llm.stats()
        llm.generate([{"prompt_token_ids": [0] * 8}], SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False, lora_request=lora)
        after = llm.stats()
        if after["lora_loads"] != before["lora_loads"] + 1:
            raise RuntimeError(f"adapter {lora.lora_name!r} was paged in {after['lora_loads'] - before['lora_loads']} "
                               "times by one request; expected once")
        loads.append(after["lora_load_seconds"] - before["lora_load_seconds"])
    stats = check_pool_free(llm, "page-in probe")
    block_bytes = stats["bytes_per_token"] * stats["block_size"]
    return PageInCost(1000 * statistics.median(reads), 1000 * statistics.median(loads), folder_megabytes(paths[0]),
                      pages, pages * block_bytes / 2**20)
