"""`pagedllm bench spec`: speculative decoding (n-gram prompt lookup by
default, or the ``--speculative-config`` given) against the same engine
without it, in the same run.

Two workloads:

- ``repetitive``: real text whose answer repeats its context, the case prompt
  lookup is for: edit a function from Python's standard library (its source,
  read locally with ``inspect``, so the workload is fixed for a Python
  version) and quote passages of a given text, through the model's chat
  template. Timed one request at a time: single-request decode speed.
- ``open-ended``: chat questions whose answers copy nothing from the
  prompt, one request at a time: lookups match only where the answer repeats
  itself, so this is what speculation costs when it has (almost) nothing to
  offer.
- ``mixed``: the throughput bench's mixed random-token requests, decoded as
  one batch (SmolLM2 loops on random tokens, so its lookups do match).

Speed is reported twice: end to end (prefill included, which speculation
cannot shorten) and decode only, from each request's first token to its last
(``RequestMetrics.first_token_time`` .. ``last_token_time``), the
"single-request decode speed" speculation is meant to raise.

Both engines decode greedily, so they must produce identical tokens (checked:
a mismatch is an error, not a figure). They run in turn, request by request
(or round by round), so load from anything else on the machine falls on both.
"""

from __future__ import annotations

import difflib
import fractions
import inspect
import shlex
import string
import textwrap
import time
from dataclasses import dataclass

from pagedllm import SamplingParams
from pagedllm.bench.throughput import mixed_requests, warm_up
from pagedllm.bench.tables import markdown_table

EDIT_TASKS = (
    (textwrap.dedent, "Add type hints to this Python function and return the whole function"),
    (shlex.quote, "Rename the argument `s` to `text` everywhere in this function and return it"),
    (textwrap.shorten, "Add type hints to this Python function and return the whole function"),
    (difflib.get_close_matches, "Rewrite this function with the docstring removed; keep the code the same"),
    (string.capwords, "Add type hints to this Python function and return the whole function"),
    (fractions.Fraction.limit_denominator, "Return this method unchanged but with its comments removed"),
    (textwrap.indent, "Add type hints to this Python function and return the whole function"),
    (shlex.split, "Rename the argument `s` to `command` everywhere in this function and return it"),
)
QUOTE_SOURCES = (difflib, textwrap, shlex, fractions)
OPEN_QUESTIONS = (
    "Why is the sky blue? Answer in a short paragraph.",
    "Write a haiku about autumn leaves.",
    "Give three tips for getting better sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a bakery that sells only bread made with rye.",
    "Explain in two sentences how a bicycle stays upright.",
    "What should I pack for a weekend hike in the mountains?",
    "Describe the taste of a ripe mango to someone who has never had one.",
)


def repetitive_prompts(tokenizer) -> list[str]:
    """Chat prompts whose answers copy much of what they are given."""
    messages = []
    for function, instruction in EDIT_TASKS:
        messages.append(f"{instruction}:\n\n```python\n{inspect.getsource(function)}```")
    for module in QUOTE_SOURCES:
        text = inspect.getdoc(module)
        messages.append(f"Here is a text:\n\n{text}\n\nQuote its first three sentences exactly.")
    return _chat_prompts(tokenizer, messages)


def open_ended_prompts(tokenizer) -> list[str]:
    """Chat prompts whose answers do not copy what they are given."""
    return _chat_prompts(tokenizer, OPEN_QUESTIONS)


def _chat_prompts(tokenizer, messages) -> list[str]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        for m in messages
    ]


@dataclass
class SpecTally:
    """One engine's share of a workload."""

    output_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    # Tokens after each request's first and the time from its first token to its last.
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class WorkloadResult:
    workload: str
    num_requests: int
    mode: str
    plain: SpecTally
    speculative: SpecTally
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def speedup(self) -> float:
        return self.speculative.tokens_per_s / self.plain.tokens_per_s

    @property
    def decode_speedup(self) -> float:
        return self.speculative.decode_tokens_per_s / self.plain.decode_tokens_per_s

    @property
    def acceptance(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)


def _timed_generate(llm, prompts: list, params: list[SamplingParams], tally: SpecTally) -> list[list[int]]:
    steps_before = llm.stats()["num_steps"]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tally.seconds += time.perf_counter() - started
    tally.steps += llm.stats()["num_steps"] - steps_before
    tokens = [o.outputs[0].token_ids for o in outputs]
    tally.output_tokens += sum(len(t) for t in tokens)
    for output in outputs:
        metrics = output.metrics
        tally.decode_tokens += len(output.outputs[0].token_ids) - 1
        tally.decode_seconds += metrics.last_token_time - metrics.first_token_time
    return tokens


def _compare(llms: tuple, batches: list[tuple[list, list[SamplingParams]]], workload: str, mode: str) -> WorkloadResult:
    """Run every batch on both engines, alternating which goes first."""
    plain_llm, speculative_llm = llms
    before = speculative_llm.stats()
    plain, speculative = SpecTally(), SpecTally()
    for index, (prompts, params) in enumerate(batches):
        order = [(plain_llm, plain), (speculative_llm, speculative)]
        results = [_timed_generate(llm, prompts, params, tally) for llm, tally in (order if index % 2 == 0 else order[::-1])]
        if results[0] != results[1]:
            raise RuntimeError(f"{workload}: greedy output differs with speculative decoding (this is a bug)")
    after = speculative_llm.stats()
    return WorkloadResult(
        workload, sum(len(p) for p, _ in batches), mode, plain, speculative,
        after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"],
        after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"],
    )


def measure(llms: tuple, output_len: int, num_mixed: int, rounds: int, seed: int) -> list[WorkloadResult]:
    """``llms``: (plain engine, speculative engine) over the same model."""
    for llm in llms:
        warm_up(llm)
    prompts = repetitive_prompts(llms[0].get_tokenizer())
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len)
    single = [([prompt], [greedy]) for prompt in prompts] * rounds
    results = [_compare(llms, single, "repetitive (code edits, quotes)", "one request at a time")]
    open_ended = [([prompt], [greedy]) for prompt in open_ended_prompts(llms[0].get_tokenizer())] * rounds
    results.append(_compare(llms, open_ended, "open-ended (chat questions)", "one request at a time"))
    requests = mixed_requests(num_mixed, llms[0].llm_engine.vocab_size, seed)
    batch = ([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
             [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests])
    results.append(_compare(llms, [batch] * rounds, "mixed (random tokens)", f"batch of {num_mixed}"))
    return results


def format_table(results: list[WorkloadResult]) -> str:
    return markdown_table(
        ["workload", "requests", "how", "output tokens", "plain tok/s", "speculative tok/s", "speed-up",
         "decode tok/s plain, speculative", "decode speed-up", "acceptance", "tokens/step plain, speculative"],
        [_workload_cells(r) for r in results])


def _workload_cells(r: WorkloadResult) -> list[object]:
    plain, speculative = r.plain, r.speculative
    return [r.workload, r.num_requests, r.mode, speculative.output_tokens, f"{plain.tokens_per_s:.1f}",
            f"{speculative.tokens_per_s:.1f}", f"{r.speedup:.2f}x",
            f"{plain.decode_tokens_per_s:.1f}, {speculative.decode_tokens_per_s:.1f}", f"{r.decode_speedup:.2f}x",
            f"{r.acceptance:.0%} ({r.num_accepted_tokens}/{r.num_draft_tokens})",
            f"{plain.output_tokens / max(1, plain.steps):.2f}, "
            f"{speculative.output_tokens / max(1, speculative.steps):.2f}"]
