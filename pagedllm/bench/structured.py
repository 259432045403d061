"""`pagedllm bench structured`: what guided rows cost the rest of a batch.

The same 32 prompts decode twice per round: all rows free, then the same batch
with ``--num-guided`` rows under a JSON schema. The schema needs far more
tokens than ``--output-len`` to complete, so guided rows never stop early and
both batches decode exactly the same number of tokens (free rows use
``ignore_eos``). Only decode steps are timed: the clock starts once every
request has its first token. Rounds alternate free and guided so machine noise
hits both; the best round of each is compared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.bench.throughput import random_requests, warm_up
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def unending_schema(output_len: int) -> dict:
    """A list of at least ``output_len`` records: a realistic JSON schema
    (objects, strings, integers, enums) that ``output_len`` tokens cannot complete."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "kind": {"enum": ["person", "place", "thing"]},
        },
        "required": ["id", "name", "kind"],
    }
    return {"type": "array", "items": record, "minItems": output_len}


@dataclass
class DecodeRun:
    num_guided: int
    decode_tokens: int
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


def decode_run(llm, prompts: list[list[int]], output_len: int, num_guided: int) -> DecodeRun:
    """Decode the batch once; the first ``num_guided`` requests are guided."""
    engine = llm.llm_engine
    guided = SamplingParams(temperature=0.0, max_tokens=output_len,
                            structured_outputs=StructuredOutputsParams(json=unending_schema(output_len)))
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, guided if i < num_guided else free)
    produced: dict[str, int] = {}
    started, tokens_at_start = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced[output.request_id] = len(output.outputs[0].token_ids)
        if started is None and len(produced) == len(prompts):
            started, tokens_at_start = time.perf_counter(), sum(produced.values())
    elapsed = time.perf_counter() - started
    if any(count != output_len for count in produced.values()):
        raise RuntimeError(f"every request must decode {output_len} tokens, got {sorted(set(produced.values()))}")
    return DecodeRun(num_guided, sum(produced.values()) - tokens_at_start, elapsed)


def measure(llm, num_prompts: int, input_len: int, output_len: int, num_guided: int, rounds: int,
            seed: int) -> tuple[DecodeRun, DecodeRun]:
    """The best (fastest) free and guided runs over ``rounds`` alternating rounds."""
    if not 0 < num_guided <= num_prompts:
        raise ValueError(f"--num-guided must be in [1, --num-prompts ({num_prompts})], got {num_guided}")
    prompts = [r.prompt_token_ids
               for r in random_requests(num_prompts, input_len, output_len, llm.llm_engine.vocab_size, seed)]
    warm_up(llm)
    decode_run(llm, prompts[:2], 4, 1)  # compiles the schema: not part of any timed run
    runs: dict[int, list[DecodeRun]] = {0: [], num_guided: []}
    for _ in range(rounds):
        for guided in runs:
            runs[guided].append(decode_run(llm, prompts, output_len, guided))
    free_best, guided_best = (max(r, key=lambda run: run.tokens_per_s) for r in runs.values())
    return free_best, guided_best


def format_table(free: DecodeRun, guided: DecodeRun, num_prompts: int) -> str:
    rows = [
        "| batch | guided rows | decode tokens | decode time (s) | decode tok/s | vs all free |",
        "|---|---|---|---|---|---|",
    ]
    for run in (free, guided):
        rows.append(f"| {num_prompts} | {run.num_guided} | {run.decode_tokens} | {run.decode_s:.2f} | "
                    f"{run.tokens_per_s:.1f} | {run.tokens_per_s / free.tokens_per_s:.3f}x |")
    loss = 100 * (1 - guided.tokens_per_s / free.tokens_per_s)
    return "\n".join(rows) + f"\n\nThroughput lost to {guided.num_guided} guided rows: {loss:.1f}%."
