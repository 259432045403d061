"""Beam search over paged sequences, as a sequence-group policy.

Each live hypothesis is a sequence in the scheduler, and each prompt's
``BeamGroup`` is the ``SequenceGroupPolicy`` (``core/sequence_group.py``) of
its beams: the scheduler hands it every beam's sampled row, whose top-K
logprobs are the beam's next-token distribution, and carries out what it
decides. A beam that reached its next position is parked (its token held
back, so the scheduler computes nothing for it) until every beam of the group
has; then the hypotheses are re-ranked. A survivor that extends parent ``p``
either *is* ``p`` (the first survivor of ``p``) or a ``Fork`` of it, so it
inherits ``p``'s block table with the counts incremented; parents with no
survivor are finished (their blocks freed), and a shared, partly filled tail
is copied on write when two survivors of one parent write different tokens
into it.

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
from pagedllm.core.runner_output import SampledTokens
from pagedllm.core.scheduler_output import SampleRow
from pagedllm.core.sequence_group import Append, Decision, Finish, Fork
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams

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


def _holds_position(beam: Request, output_position: int) -> bool:
    """Whether a parked beam's distribution still describes it: the beam runs
    with all its tokens computed, and the distribution is for its next output
    position. A beam preempted since is being recomputed (no fork parent: its
    blocks are partly gone) and parks again when its recompute samples; a row
    sampled by such a recompute after the group ranked without it is for a
    position already decided."""
    return (beam.status is RequestStatus.RUNNING and beam.num_computed_tokens == beam.num_tokens
            and output_position == beam.num_output_tokens)


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
    """One prompt's beam search: HF's ranking state, and the sequence-group
    policy of its beams (pure Python); a ``UserRequest`` of the engine. Its first beam is the request itself
    (id ``request_id``), which reserves ``beam_width`` places at admission.

    Safety rule: beams are never swapped (``may_swap``): a parked beam that is
    preempted must sample its position again, which only a recompute does.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: list[int]
    metrics: RequestMetrics
    # running sequence id -> cumulative logprob; the request itself at first.
    running: dict[str, float] = field(init=False)
    finished: list[_Hypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False
    # Beams that reached their next position, waiting for the rest of the group
    # (a sibling preempted this step catches up in a later one): each with the
    # output position its next-token distribution is for.
    parked: dict[str, tuple[Request, int, PositionLogprobs]] = field(default_factory=dict)
    # Numbers the forks' ids ("<request id>::beam<k>") within the group.
    fork_numbers: itertools.count = field(default_factory=lambda: itertools.count(1))

    # The policy's facts: a beam samples one row (its top-K logprobs rank the
    # candidates; the sampled token is ignored), never swaps, never speculates.
    may_swap = False
    may_speculate = False
    streams_tokens = False  # (``UserRequest``) it reports itself, once done

    @property
    def num_completions(self) -> int:
        return self.params.beam_width

    def output_lengths(self) -> list[int]:  # no hypothesis is reported before the search is done
        return []

    def own_output(self, tokenizer) -> RequestOutput | None:
        return self.request_output(tokenizer) if self.done else None

    def __post_init__(self) -> None:
        self.running = {self.request_id: 0.0}

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

    def num_rows(self, request: Request) -> int:
        return 1

    def decide(self, request: Request, rows: list[SampleRow], sampled: Mapping[str, SampledTokens]) -> list[Decision]:
        """Park the beam with its next-token distribution; once every running
        beam has one, rank them and return the group's forks, appends and
        finishes (every beam finishes when the search is done)."""
        parked = self.parked
        parked[request.request_id] = (request, rows[0].output_position,
                                      sampled[request.request_id].position_logprobs[0])
        for rid in [rid for rid, (r, position, _) in parked.items() if not _holds_position(r, position)]:
            del parked[rid]
        if set(parked) != set(self.running):
            return []  # every running beam needs its next-token distribution first
        self.parked = {}
        beams = {rid: r for rid, (r, _, _) in parked.items()}
        return self._decisions(beams, self.rank(beams, {rid: lp for rid, (_, _, lp) in parked.items()}))

    def _decisions(self, beams: dict[str, Request], plan: list[tuple[str, int, float]]) -> list[Decision]:
        """The ranking's plan as decisions: forks first (they must copy the
        parent before it appends), then appends, then the beams left behind."""
        forks: list[Decision] = []
        appends: list[Decision] = []
        running: dict[str, float] = {}
        for parent_id, token, score in plan:
            sequence_id = parent_id
            if parent_id in running:
                sequence_id = f"{self.request_id}::beam{next(self.fork_numbers)}"
                forks.append(Fork(parent_id, sequence_id, 0, beams[parent_id].seed))
            appends.append(Append(sequence_id, [token]))
            running[sequence_id] = score
        finishes = [Finish(rid, RequestStatus.FINISHED_STOPPED) for rid in self.running if rid not in running]
        self.running = running
        return forks + appends + finishes

    def request_output(self, tokenizer) -> RequestOutput:
        """The finished search's one output: the ``beam_width`` best hypotheses, best first."""
        self.metrics.finished_time = time.time()
        completions = [
            CompletionOutput(
                index=i,
                text=tokenizer.decode(h.output_token_ids, skip_special_tokens=True),
                token_ids=h.output_token_ids,
                cumulative_logprob=h.cum_logprob,
                logprobs=None,
                finish_reason="stop" if h.finished_by_eos else "length",
            )
            for i, h in enumerate(self.finished)
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=True,
            metrics=self.metrics,
        )


def new_beam_group(input_processor: InputProcessor, eos_token_ids: list[int], request_id: str, prompt: PromptType,
                   params: BeamSearchParams, arrival_time: float | None, priority: int,
                   cache_salt: str | None) -> tuple[Request, BeamGroup]:
    """A beam search's first beam (to queue) and its group, which ranks the hypotheses."""
    group = BeamGroup(request_id, None, [], params, eos_token_ids, RequestMetrics(arrival_time=time.time()))
    # The sampled token is ignored; the top-K distribution ranks the beams.
    sampling = SamplingParams(
        temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=group.num_candidates
    )
    # Admission reserves beam_width places; the group's policy decides each step's tokens.
    request, group.prompt = input_processor.new_request(
        request_id, prompt, sampling, params.beam_width, arrival_time, priority, cache_salt, group_policy=group
    )
    group.prompt_token_ids = request.prompt_token_ids
    group.metrics.arrival_time = request.arrival_time
    return request, group
