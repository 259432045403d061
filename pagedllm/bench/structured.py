"""`pagedllm bench structured`: what guided rows cost the rest of a batch.

Two engines with the same model decode the same 32 prompts at once: one
batch with every row free, one with ``--num-guided`` rows under a JSON schema. The schema needs
far more tokens than ``--output-len`` to complete, so guided rows never stop
early and both batches decode exactly the same tokens (free rows use
``ignore_eos``). The two engines step in turn, one step each, so load from
anything else on the machine falls on both alike; over four rounds each
engine runs each batch, stepping first and second once, so neither engine nor
order favours a side. Only decode steps (those that start with every request
past its first token) are timed. ``--num-guided 0`` compares two free batches: the
noise floor of the measurement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.bench.throughput import random_requests, warm_up
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.bench.tables import markdown_table


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
class DecodeTally:
    num_guided: int
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


class _BatchRun:
    """One engine decoding the batch, stepped from outside so two runs interleave.
    The first ``tally.num_guided`` requests are guided."""

    def __init__(self, llm, prompts: list[list[int]], output_len: int, tally: DecodeTally) -> None:
        self.engine = llm.llm_engine
        self.output_len = output_len
        self.tally = tally
        guided = SamplingParams(temperature=0.0, max_tokens=output_len,
                                structured_outputs=StructuredOutputsParams(json=unending_schema(output_len)))
        free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            params = guided if i < tally.num_guided else free
            self.engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)
        self.num_requests = len(prompts)
        self.produced: dict[str, int] = {}

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        decoding = len(self.produced) == self.num_requests
        before = sum(self.produced.values())
        started = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - started
        for output in outputs:
            self.produced[output.request_id] = len(output.outputs[0].token_ids)
        if decoding:
            self.tally.decode_s += elapsed
            self.tally.decode_tokens += sum(self.produced.values()) - before
        if self.done and set(self.produced.values()) != {self.output_len}:
            raise RuntimeError(f"every request must decode {self.output_len} tokens, got {set(self.produced.values())}")


def measure(llms: tuple, num_prompts: int, input_len: int, output_len: int, num_guided: int,
            rounds: int, seed: int) -> tuple[DecodeTally, DecodeTally]:
    """Decode tallies of the all-free and the partly guided batch over ``rounds``
    interleaved runs on the two engines ``llms``."""
    if not 0 <= num_guided <= num_prompts:
        raise ValueError(f"--num-guided must be in [0, --num-prompts ({num_prompts})], got {num_guided}")
    prompts = [r.prompt_token_ids
               for r in random_requests(num_prompts, input_len, output_len, llms[0].llm_engine.vocab_size, seed)]
    for llm in llms:
        warm_up(llm)
        _drive([_BatchRun(llm, prompts[:2], 4, DecodeTally(1))])  # compiles the schema, untimed
    free, guided = DecodeTally(0), DecodeTally(num_guided)
    for round_index in range(rounds):
        free_llm, guided_llm = llms if round_index % 2 == 0 else llms[::-1]
        runs = [_BatchRun(free_llm, prompts, output_len, free), _BatchRun(guided_llm, prompts, output_len, guided)]
        _drive(runs if round_index // 2 % 2 == 0 else runs[::-1])
    return free, guided


def _drive(runs: list[_BatchRun]) -> None:
    while not all(run.done for run in runs):
        for run in runs:
            if not run.done:
                run.step()


def format_table(free: DecodeTally, guided: DecodeTally, num_prompts: int) -> str:
    table = markdown_table(
        ["batch", "guided rows", "decode tokens", "decode time (s)", "decode tok/s", "vs all free"],
        [[num_prompts, tally.num_guided, tally.decode_tokens, f"{tally.decode_s:.2f}", f"{tally.tokens_per_s:.1f}",
          f"{tally.tokens_per_s / free.tokens_per_s:.3f}x"] for tally in (free, guided)])
    loss = 100 * (1 - guided.tokens_per_s / free.tokens_per_s)
    return table + f"\n\nDecode throughput lost to {guided.num_guided} guided rows: {loss:.1f}%."
