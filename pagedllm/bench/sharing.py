"""`pagedllm bench sharing`: KV blocks saved by sharing prompt blocks between
parallel samples and beam hypotheses, against the same runs with sharing off
(every fork copies its parent's blocks)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm import BeamSearchParams, SamplingParams
from pagedllm.bench.throughput import random_requests
from pagedllm.bench.tables import markdown_table


@dataclass
class SharingRow:
    workload: str
    peak_blocks_shared: int
    peak_blocks_unshared: int

    @property
    def saving_percent(self) -> float:
        return 100.0 * (1 - self.peak_blocks_shared / self.peak_blocks_unshared)

    @property
    def ratio(self) -> float:
        return self.peak_blocks_unshared / self.peak_blocks_shared


def measure(make_llm, prompt_len: int, output_len: int, ns: list[int], widths: list[int]) -> list[SharingRow]:
    """Run every workload once with sharing and once without; ``make_llm(sharing)``
    builds an engine. Peak blocks are reset between workloads."""
    engines = {sharing: make_llm(sharing) for sharing in (True, False)}
    vocab = engines[True].llm_engine.vocab_size
    prompt = {"prompt_token_ids": random_requests(1, prompt_len, output_len, vocab)[0].prompt_token_ids}
    workloads = [
        (f"n={n}", lambda llm, n=n: llm.generate(
            prompt, SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=output_len, ignore_eos=True), use_tqdm=False
        ))
        for n in ns
    ] + [
        (f"beam width {w}", lambda llm, w=w: llm.beam_search(
            [prompt], BeamSearchParams(beam_width=w, max_tokens=output_len, ignore_eos=True)
        ))
        for w in widths
    ]
    rows = []
    for name, run in workloads:
        peaks = {}
        for sharing, llm in engines.items():
            llm.reset_peak_blocks_in_use()
            run(llm)
            peaks[sharing] = llm.stats()["peak_blocks_in_use"]
        rows.append(SharingRow(name, peaks[True], peaks[False]))
    return rows


def format_table(rows: list[SharingRow], block_size: int) -> str:
    return markdown_table(
        ["workload", "peak blocks, sharing", "peak blocks, no sharing", "saving", "no sharing / sharing"],
        [[r.workload, f"{r.peak_blocks_shared} ({r.peak_blocks_shared * block_size} tok)",
          f"{r.peak_blocks_unshared} ({r.peak_blocks_unshared * block_size} tok)", f"{r.saving_percent:.1f}%",
          f"{r.ratio:.2f}x"] for r in rows])
