"""Beam search over paged sequences.

Each live hypothesis is a sequence in the scheduler. After every step the
hypotheses are re-ranked; a survivor that extends parent ``p`` either *is*
``p`` (the first survivor of ``p``) or a fork of it, so it inherits ``p``'s
block table with the counts incremented; parents with no survivor are freed,
and a shared, partly filled tail is copied on write when two survivors of one
parent write different tokens into it.

The ranking mirrors Hugging Face ``generate(num_beams=W, do_sample=False)``
(transformers 4.50+): keep the top ``K = max(2, 1 + #eos) * W`` continuations
of all beams, the best ``W`` that did not finish keep running, finished ones
among the top ``W`` enter a bounded list of ``W`` hypotheses scored
``sum_logprobs / generated_len ** length_penalty``, and the search stops by
HF's ``early_stopping`` rule.

Two ways of ignoring EOS, because Hugging Face and vLLM mean different things:
``min_tokens`` is HF's ``min_new_tokens`` (EOS's logprob is -inf, not
renormalised, until that many tokens exist: no hypothesis ends early), and
``ignore_eos`` is vLLM's (EOS is an ordinary token: a hypothesis may generate
it and go on, as HF does with ``eos_token_id=None``). See docs/differential.md.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedllm.core.request import Request, RequestStatus
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput

_NEG_INF = -1.0e9


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` plus HF's ``early_stopping`` (True, False or
    "never") and ``min_tokens`` (HF's ``min_new_tokens``: EOS is forbidden
    before that many tokens). ``ignore_eos`` is vLLM's: EOS is an ordinary token."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        _check_count("beam_width", self.beam_width, 1)
        _check_count("max_tokens", self.max_tokens, 1)
        _check_count("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"BeamSearchParams.early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )


def _check_count(name: str, value: object, low: int, high: int | None = None) -> None:
    """A ValueError naming the field unless ``value`` is an int in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, max_tokens]" if high is not None else f">= {low}"
        raise ValueError(f"BeamSearchParams.{name} must be an integer {bound}, got {value!r}")


@dataclass
class BeamSearchSequence:
    """A finished hypothesis: ``tokens`` holds prompt + generated ids (vLLM's shape)."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass
class _Hypothesis:
    score: float
    output_token_ids: list[int]
    cum_logprob: float
    finished_by_eos: bool


@dataclass
class BeamGroup:
    """The ranking state of one prompt's beam search (pure Python)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: list[int]
    metrics: RequestMetrics
    # running sequence id -> cumulative logprob
    running: dict[str, float] = field(default_factory=dict)
    finished: list[_Hypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False
    # Beams that reached their next position, waiting for the rest of the group
    # (a sibling preempted this step catches up in a later one).
    parked: dict[str, tuple[Request, PositionLogprobs]] = field(default_factory=dict)

    def live_sequence_ids(self) -> list[str]:
        """Ids of the beams still in the scheduler."""
        return list(self.running)

    @property
    def num_candidates(self) -> int:
        num_eos = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        return max(2, 1 + num_eos) * self.params.beam_width

    def _length_score(self, logprob: float, generated: int) -> float:
        return logprob / (generated**self.params.length_penalty)

    def rank(
        self, requests: dict[str, Request], logprobs: dict[str, PositionLogprobs]
    ) -> list[tuple[str, int, float]]:
        """One step of HF's beam search. Returns the next running beams as
        (parent sequence id, token, cumulative logprob), best first, and updates
        the finished list and the stopping state."""
        width = self.params.beam_width
        generated = requests[next(iter(self.running))].num_output_tokens + 1  # length after this step
        # HF's min_new_tokens: EOS's logprob is -inf while fewer than min_tokens exist.
        forbidden = set(self.eos_token_ids) if generated <= self.params.min_tokens else set()
        candidates = sorted(
            (
                (cum + entry.logprob, parent, token)
                for parent, cum in self.running.items()
                for token, entry in logprobs[parent].items()
                if token not in forbidden
            ),
            key=lambda c: c[0],
            reverse=True,
        )[: self.num_candidates]
        at_max_length = generated >= self.params.max_tokens
        # Under ignore_eos an EOS is an ordinary token: it ends no hypothesis.
        ending = set() if self.params.ignore_eos else set(self.eos_token_ids)
        hits = [at_max_length or t in ending for _, _, t in candidates]

        next_running = [c for c, hit in zip(candidates, hits) if not hit][:width]
        all_full = len(self.finished) == width
        accepting = self.improvement_possible and not (all_full and self.params.early_stopping is True)
        for (score, parent, token), hit in list(zip(candidates, hits))[:width]:
            if hit and accepting:
                tokens = requests[parent].output_token_ids + [token]
                self.finished.append(
                    _Hypothesis(self._length_score(score, generated), tokens, score, token in ending)
                )
        self.finished = sorted(self.finished, key=lambda h: h.score, reverse=True)[:width]

        if next_running:
            best_len = generated
            if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
                best_len = self.params.max_tokens
            best_possible = self._length_score(next_running[0][0], best_len)
            full = len(self.finished) == width
            worst_finished = min(h.score for h in self.finished) if full else _NEG_INF
            self.improvement_possible = self.improvement_possible and best_possible > worst_finished
        full = len(self.finished) == width
        self.done = (
            not next_running
            or not self.improvement_possible
            or (full and self.params.early_stopping is True)
            or all(hits)
        )
        return [] if self.done else [(parent, token, score) for score, parent, token in next_running]


class BeamSearchManager:
    """Drives beam groups: applies each step's ranking to the scheduler as forks,
    appends and frees, and reports finished groups. The groups themselves live
    in the engine's registry of user requests and are passed in."""

    def __init__(self, scheduler, tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._ids = itertools.count(1)

    @staticmethod
    def start(group: BeamGroup, first: Request) -> None:
        """Make ``first`` the group's one beam until its first step forks it."""
        first.tokens_chosen_externally = True
        # The admission reserves beam_width places in max_num_seqs.
        first.num_pending_samples = group.params.beam_width
        group.running[first.request_id] = 0.0

    def on_step(
        self, advanced: list[Request], logprobs: Mapping[str, PositionLogprobs], groups: Mapping[str, object]
    ) -> list[RequestOutput]:
        """Rank the groups whose every beam reached its next position (``advanced``
        are the beams that did this step; ``groups`` maps user request ids to
        their state, beam groups among them)."""
        ready: dict[str, dict[str, Request]] = {}
        for request in advanced:
            if isinstance(groups.get(request.group_id), BeamGroup):
                ready.setdefault(request.group_id, {})[request.request_id] = request
        outputs = []
        for group_id, requests in ready.items():
            group = groups[group_id]
            parked = group.parked
            parked.update({rid: (r, logprobs[rid]) for rid, r in requests.items()})
            # A parked beam preempted since is recomputed and parks again later;
            # until then it is no fork parent (its blocks are gone).
            for rid in [rid for rid, (r, _) in parked.items() if r.status is not RequestStatus.RUNNING]:
                del parked[rid]
            if set(parked) != set(group.running):
                continue  # every running beam needs its next-token distribution first
            group.parked = {}
            beams = {rid: r for rid, (r, _) in parked.items()}
            plan = group.rank(beams, {rid: lp for rid, (_, lp) in parked.items()})
            self._apply(group, beams, plan)
            if group.done:
                outputs.append(self._finish(group))
        return outputs

    def _apply(self, group: BeamGroup, requests: dict[str, Request], plan: list[tuple[str, int, float]]) -> None:
        used: set[str] = set()
        extensions: list[tuple[Request, int]] = []
        running: dict[str, float] = {}
        # Forks first (they must copy the parent before it appends), then appends.
        for parent_id, token, score in plan:
            parent = requests[parent_id]
            if parent_id in used:
                child_id = f"{group.request_id}::beam{next(self._ids)}"
                child = self.scheduler.fork_request(parent, child_id, sample_index=0, seed=parent.seed)
                extensions.append((child, token))
                running[child_id] = score
            else:
                used.add(parent_id)
                extensions.append((parent, token))
                running[parent_id] = score
        for request, token in extensions:
            self.scheduler.settle_samples(request)
            self.scheduler.append_token(request, token)
        for rid in group.running:
            if rid not in used:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        group.running = running

    def _finish(self, group: BeamGroup) -> RequestOutput:
        for rid in group.running:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        group.running = {}
        group.metrics.finished_time = time.time()
        completions = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.output_token_ids, skip_special_tokens=True),
                token_ids=h.output_token_ids,
                cumulative_logprob=h.cum_logprob,
                logprobs=None,
                finish_reason="stop" if h.finished_by_eos else "length",
            )
            for i, h in enumerate(group.finished)
        ]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=True,
            metrics=group.metrics,
        )
