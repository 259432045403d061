"""Per-step host costs of the engine, for BENCHMARKS.md and scripts/gpu_check.sh.

``mixed``: the throughput bench's mixed workload through ``run_pagedllm``;
prints milliseconds per step of each phase (the engine's ``step_timings``).
``decode``: N sequences all decoding (short prompts, long outputs); prints the
mean wall time of a decode-only step (synchronized on CUDA), eager and, on
CUDA, with graphs, and checks that both give the same greedy tokens.
``prepare``: the runner's input preparation alone, N sequences decoding (no model).

    PYTHONPATH=. python scripts/step_times.py mixed --num-prompts 64
    PYTHONPATH=. python scripts/step_times.py decode --num-seqs 256 --device cuda --dtype bfloat16
    PYTHONPATH=. python scripts/step_times.py prepare --num-seqs 256 --num-steps 50
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import mixed_requests, run_pagedllm, warm_up
from pagedllm.core.scheduler_output import NewSequenceData, ScheduledSequence, SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner


def mixed(args: argparse.Namespace) -> None:
    # Only set when asked, so the script also measures checkouts without the option.
    llm = LLM(device=args.device, dtype=args.dtype, **({"enforce_eager": True} if args.enforce_eager else {}))
    engine = llm.llm_engine
    requests = mixed_requests(args.num_prompts, engine.vocab_size, seed=0)
    warm_up(llm)  # counts the warm-up's steps: run_pagedllm warms up again before it times
    warm_up_steps = engine.num_steps
    steps_before = engine.num_steps
    result = run_pagedllm(llm, requests)
    steps = engine.num_steps - steps_before - warm_up_steps
    split = ", ".join(f"{name} {1000 * s / steps:.3f} ms" for name, s in engine.step_timings.items())
    print(f"mixed {args.num_prompts}: {result.output_tokens} output tokens in {result.elapsed_s:.1f} s, "
          f"{steps} steps; per step: {split}")


def decode_step_ms(llm: LLM, num_seqs: int, num_steps: int) -> tuple[float, float, list[list[int]]]:
    """Mean wall ms of ``num_steps`` decode-only steps with ``num_seqs`` running,
    the mean ms of their input preparation, and the greedy tokens."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 8, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(8)]}, params)
    while engine.scheduler.num_waiting or engine.num_steps == 0:  # prefills
        engine.step()
    for _ in range(2):
        engine.step()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    engine.reset_step_timings()
    started = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    sync()
    elapsed = time.perf_counter() - started
    preparation = engine.step_timings["input preparation"]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    return 1000 * elapsed / num_steps, 1000 * preparation / num_steps, [outputs[f"r{i}"] for i in range(num_seqs)]


def decode(args: argparse.Namespace) -> None:
    modes = [True, False] if args.device == "cuda" else [True]
    tokens = {}
    for eager in modes:
        # Two engines may be alive at once (the first one's pool is not always freed
        # at once), so each takes well under half the GPU.
        options = {"gpu_memory_utilization": 0.4} if args.device == "cuda" else {}
        if args.device == "cuda":  # set only where it matters, so older checkouts run the CPU case
            options["enforce_eager"] = eager
        llm = LLM(device=args.device, dtype=args.dtype, max_num_seqs=args.num_seqs, **options)
        ms, preparation_ms, tokens[eager] = decode_step_ms(llm, args.num_seqs, args.num_steps)
        print(f"decode step at {args.num_seqs} sequences ({'eager' if eager else 'CUDA graphs'}): {ms:.2f} ms "
              f"(input preparation {preparation_ms:.3f} ms)")
        del llm
    if len(tokens) == 2 and tokens[True] != tokens[False]:
        raise SystemExit("greedy tokens differ between CUDA graphs and eager")


def prepare(args: argparse.Namespace) -> None:
    """The runner's input preparation alone (diffs applied, inputs built), for
    ``num_seqs`` sequences decoding with 200-token contexts: no model runs."""
    config = SimpleNamespace(num_hidden_layers=1, head_dim=8)
    block_size, context = 16, 200
    # Each sequence owns 16 blocks: contexts up to 256 tokens, so at most 56 steps.
    runner = ModelRunner(SimpleNamespace(config=config, num_kv_heads=1), args.num_seqs * 16, block_size,
                         torch.device("cpu"), torch.float32, [])
    ids = [f"s{i}" for i in range(args.num_seqs)]
    tables = {sid: list(range(i * 16, i * 16 + 13)) for i, sid in enumerate(ids)}
    runner._update_sequences(SchedulerOutput(new_sequences=[
        NewSequenceData(sid, list(range(1, context + 1)), [], tables[sid], SamplingParams()) for sid in ids]))
    elapsed = 0.0
    for step in range(args.num_steps):
        position = context + step
        output = SchedulerOutput(scheduled=[
            ScheduledSequence(sid, position, 1, new_token_ids=[position % 1000 + 1],
                              new_block_ids=[tables[sid][0] + position // block_size] if position % block_size == 0 else [])
            for sid in ids])
        started = time.perf_counter()
        runner._update_sequences(output)
        runner._prepare(output)
        elapsed += time.perf_counter() - started
    print(f"input preparation at {args.num_seqs} decoding sequences: {1000 * elapsed / args.num_steps:.3f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["mixed", "decode", "prepare"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=20)
    args = parser.parse_args()
    {"mixed": mixed, "decode": decode, "prepare": prepare}[args.what](args)


if __name__ == "__main__":
    main()
