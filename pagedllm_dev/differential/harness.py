"""Running one case: a feature and its oracle on the same prompts.

A case owns the engines it builds; ``run_case`` checks afterwards that every
one of them is idle with its whole block pool free, because a differential run
is also a leak test over many more requests than a unit test makes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedllm_dev.differential.compare import Comparison, DifferentialReport, Generation

GenerateFn = Callable[[list[str]], list[Generation]]


@dataclass
class DifferentialCase:
    """``feature`` and ``oracle`` each map the prompts to one generation per
    prompt, in order. ``engines`` are the LLMs the case runs (their pools are
    checked after the run)."""

    name: str
    oracle: GenerateFn
    feature: GenerateFn
    engines: Sequence = field(default_factory=tuple)


def run_case(case: DifferentialCase, prompts: list[str]) -> DifferentialReport:
    """Both sides on every prompt; raises RuntimeError when a side returns the
    wrong number of generations or an engine is left holding blocks."""
    expected = case.oracle(prompts)
    got = case.feature(prompts)
    if len(expected) != len(prompts) or len(got) != len(prompts):
        raise RuntimeError(f"case {case.name}: {len(prompts)} prompts gave {len(expected)} oracle and "
                           f"{len(got)} feature generations")
    for llm in case.engines:
        check_pool_free(llm, case.name)
    return DifferentialReport(case.name, [Comparison(p, e, g) for p, e, g in zip(prompts, expected, got)])


def check_pool_free(llm, case_name: str) -> None:
    """The engine is idle and every block is back in the pool (cached blocks
    count as free: they are evictable)."""
    stats = llm.stats()
    if llm.llm_engine.has_unfinished_requests() or stats["num_free_blocks"] != stats["num_blocks"]:
        raise RuntimeError(f"case {case_name} left blocks in use: {stats['num_blocks'] - stats['num_free_blocks']} "
                           f"of {stats['num_blocks']}")
    llm.llm_engine.check_invariants()
