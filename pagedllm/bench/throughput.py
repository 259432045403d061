"""`pagedllm bench throughput`: offline throughput of pagedllm vs a baseline on the same requests."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from pagedllm import SamplingParams
from pagedllm.bench.json_records import read_json_records
from pagedllm.logger import init_logger
from pagedllm.bench.tables import markdown_table

logger = init_logger(__name__)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class BenchResult:
    engine: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    mean_batch: float | None = None  # running sequences per step (pagedllm only)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def token_range(vocab_size: int) -> tuple[int, int]:
    """Token ids random prompts draw from: clear of the special tokens at both ends of the vocabulary."""
    margin = min(100, vocab_size // 4)
    return margin, vocab_size - margin


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Random token ids (clear of the special tokens at the ends of the vocabulary)."""
    rng = random.Random(seed)
    low, high = token_range(vocab_size)
    return [BenchRequest([rng.randrange(low, high) for _ in range(input_len)], output_len) for _ in range(num)]


def mixed_requests(num: int, vocab_size: int, seed: int = 0,
                   prompt_range: tuple[int, int] = (16, 512), output_range: tuple[int, int] = (16, 256)) -> list[BenchRequest]:
    """Issue 8's mixed workload: prompt and output lengths log-uniform over the ranges
    (most requests short, a few long; 64 requests give about 9k prompt and 5-6k output tokens)."""
    rng = random.Random(seed)
    low, high = token_range(vocab_size)

    def log_uniform(bounds: tuple[int, int]) -> int:
        return round(math.exp(rng.uniform(math.log(bounds[0]), math.log(bounds[1]))))

    return [
        BenchRequest([rng.randrange(low, high) for _ in range(log_uniform(prompt_range))], log_uniform(output_range))
        for _ in range(num)
    ]


def load_requests(path: str) -> list[BenchRequest]:
    """A JSON list of ``{"prompt_token_ids": [...], "max_tokens": N}``."""
    return read_json_records(
        path, "prompt_token_ids, max_tokens",
        lambda item: BenchRequest(list(item["prompt_token_ids"]), int(item["max_tokens"])),
    )


def finished(result: BenchResult) -> BenchResult:
    """Log each engine's figure as it completes: the table comes only at the end of a long run."""
    logger.info("%s: %.2f s, %.1f total tok/s", result.engine, result.elapsed_s, result.total_tokens_per_s)
    return result


def warm_up(llm) -> None:
    """One short untimed request, so one-time costs (Triton compiling its kernel,
    cuBLAS and allocator start-up on a GPU) stay out of the timed run. Its 8-token
    prompt fills no whole block, so it leaves nothing in the prefix cache."""
    llm.generate([{"prompt_token_ids": [0] * 8}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)


def run_pagedllm(llm, requests: list[BenchRequest], label: str = "pagedllm", lora_request=None) -> BenchResult:
    """Time ``requests`` on ``llm`` after its warm-up; the engine's step-time split
    then covers the timed requests alone. ``lora_request``: as ``LLM.generate`` takes it."""
    warm_up(llm)
    llm.reset_step_timings()
    # ignore_eos makes every engine produce exactly max_tokens tokens, so the work is equal.
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    steps = after["num_steps"] - before["num_steps"]
    return finished(BenchResult(
        engine=label,
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed_s=elapsed,
        mean_batch=(after["num_scheduled_sequences"] - before["num_scheduled_sequences"]) / max(1, steps),
    ))


@torch.inference_mode()
def run_hf(model, requests: list[BenchRequest], batch_size: int) -> BenchResult:
    """Hugging Face ``generate`` (``model``: ``load_hf_model``'s, on the device to
    measure) in static, left-padded batches of ``batch_size`` (requests sorted by
    length so padding is small, as vLLM's HF baseline does), after one short
    untimed call. Only the tokens each request asked for are counted."""
    device = model.device
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ordered = sorted(requests, key=lambda r: (len(r.prompt_token_ids), r.max_tokens))
    model.generate(input_ids=torch.zeros((1, 8), dtype=torch.long, device=device), max_new_tokens=4,
                   min_new_tokens=4, do_sample=False, pad_token_id=pad_id)
    start = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = ordered[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids) :] = 1
        new_tokens = max(r.max_tokens for r in batch)
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    return finished(BenchResult(
        engine=f"hf generate (batch {batch_size})",
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(r.max_tokens for r in requests),
        elapsed_s=elapsed,
    ))


@torch.no_grad()
def run_hf_continuous(model, requests: list[BenchRequest]) -> BenchResult:
    """Hugging Face's own continuous batching (``generate_batch``'s manager, paged
    KV cache, sdpa). Each request keeps its own ``max_new_tokens`` and EOS is
    off, so it generates exactly the tokens pagedllm does. The clock starts once
    the manager is up (its set-up and warm-up are not counted).

    ``no_grad`` rather than ``inference_mode``: the manager's thread writes in place to the
    buffers it makes here (on CUDA, its static inputs), which inference tensors
    forbid outside that mode."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests), eos_token_id=-1)
    output_tokens = 0
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        start = time.perf_counter()
        for r in requests:
            manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
        num_finished = 0
        while num_finished < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.error is not None:
                # A failed request also counts as finished: never time it as a result.
                raise RuntimeError(f"Hugging Face's continuous batching failed a request: {result.error}")
            if result is not None and result.is_finished():
                num_finished += 1
                output_tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("Hugging Face's continuous batching stopped before finishing the requests")
        elapsed = time.perf_counter() - start
    expected = sum(r.max_tokens for r in requests)
    if output_tokens != expected:
        raise RuntimeError(f"Hugging Face's continuous batching generated {output_tokens} of {expected} tokens")
    return finished(BenchResult(
        engine="hf generate_batch (continuous, paged)",
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=output_tokens,
        elapsed_s=elapsed,
    ))


def format_table(results: list[BenchResult]) -> str:
    """One row per engine; "vs baseline" divides by the best non-pagedllm row (or the last row)."""
    baselines = [r for r in results if not r.engine.startswith("pagedllm")] or results[-1:]
    base = max(baselines, key=lambda r: r.total_tokens_per_s) if len(results) > 1 else None
    header = ["engine", "requests", "prompt tok", "output tok", "time (s)", "req/s", "output tok/s", "total tok/s",
              "mean batch"]
    rows = []
    for r in results:
        rows.append([r.engine, r.num_requests, r.prompt_tokens, r.output_tokens, f"{r.elapsed_s:.2f}",
                     f"{r.requests_per_s:.2f}", f"{r.output_tokens_per_s:.1f}", f"{r.total_tokens_per_s:.1f}",
                     "-" if r.mean_batch is None else f"{r.mean_batch:.1f}"])
        if base:
            rows[-1].append(f"{r.total_tokens_per_s / base.total_tokens_per_s:.2f}x")
    return markdown_table(header + ["vs baseline"] * (base is not None), rows)


def format_pool_table(rows: list[tuple[str, dict]]) -> str:
    """Per engine: the pool's size and what it allowed (for KV storage comparisons)."""
    return markdown_table(
        ["engine", "KV bytes/token", "blocks", "token capacity", "peak blocks in use", "max concurrent sequences",
         "mean batch", "preemptions"],
        [[label, stats["bytes_per_token"], stats["num_blocks"], stats["token_capacity"], stats["peak_blocks_in_use"],
          stats["peak_running_per_step"], f"{stats['mean_running_per_step']:.1f}", stats["num_preemptions"]]
         for label, stats in rows])


def tensor_parallel_traffic(model_config, activation_bytes: int, tp_size: int, num_batched_tokens: int,
                            num_steps: int) -> str:
    """What the all-reduces move: two per layer (after o_proj and down_proj),
    each of [tokens, hidden] activations; a ring all-reduce sends 2(N-1)/N of
    that from every rank. Plus the step broadcast, which is token ids and block
    tables (a few KiB)."""
    per_token = 2 * model_config.num_hidden_layers * model_config.hidden_size * activation_bytes
    ring = 2 * (tp_size - 1) / tp_size
    tokens_per_step = num_batched_tokens / max(1, num_steps)
    return (
        f"tensor parallel ({tp_size} ranks): all-reduce payload {per_token / 1024:.1f} KiB per token "
        f"(2 x {model_config.num_hidden_layers} layers x {model_config.hidden_size} x {activation_bytes} bytes), "
        f"{tokens_per_step:.1f} tokens per step on average = {per_token * tokens_per_step / 2**20:.2f} MiB per step; "
        f"each rank sends {ring:.2f}x that over a ring"
    )


def format_ratios(results: list[BenchResult]) -> str:
    """pagedllm's total tokens/s over each kind of baseline: the best static
    ``generate`` batch size, and Hugging Face's continuous batching when run."""
    ours, others = results[0], results[1:]
    kinds = {
        "Hugging Face `generate` (best batch size)": [r for r in others if r.engine.startswith("hf generate (")],
        "Hugging Face continuous batching (`generate_batch`)": [r for r in others if "generate_batch" in r.engine],
    }
    lines = []
    for kind, rows in kinds.items():
        if rows:
            best = max(rows, key=lambda r: r.total_tokens_per_s)
            lines.append(f"{ours.engine} vs {kind}: **{ours.total_tokens_per_s / best.total_tokens_per_s:.2f}x**")
    return "\n".join(lines)


def hf_has_continuous_batching() -> bool:
    from transformers import GenerationMixin

    return hasattr(GenerationMixin, "generate_batch")


def format_step_split(timings: dict[str, float]) -> str:
    """Where engine step time went: bookkeeping (scheduler, block manager, outputs),
    input preparation, forward pass, sampling."""
    total = sum(timings.values()) or 1.0
    return ", ".join(f"{name} {100 * seconds / total:.1f}%" for name, seconds in timings.items())


def machine_description(device: torch.device | None = None) -> str:
    from pagedllm.bench.record import cpu_description

    host = f"{cpu_description()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}), host {host}"
    return host
