"""The grammar state of every guided sequence: one xgrammar matcher each.

Modelled on vLLM v1's StructuredOutputManager. Per step the engine asks for
the bitmask of the step's guided sample rows (``bitmask_for``), hands it to
the runner with the SchedulerOutput, then feeds the sampled tokens back
(``accept``) before the scheduler appends them.

Why the state stays right:
- Forks (n > 1): the rows of a sequence about to fork are all masked from its
  matcher; each future sample then gets a ``fork()`` of it before anyone
  accepts a token, so every sample starts from the same grammar state.
- Preemption: recompute and swap both keep a sequence's generated token ids,
  and the matcher has accepted exactly those, so it stays valid. Each mask
  checks that the row's output position equals the tokens its matcher
  accepted, so any drift is a loud error instead of a wrong mask.
- Release: ``retain`` drops the matchers of sequences that are no longer live
  (finished, stopped by a string, aborted).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.core.grammar_bitmask import GrammarBitmask
from pagedllm.core.runner_output import SampledTokens
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.logger import init_logger
from pagedllm.sampling_params import ReasoningGate, SamplingParams
from pagedllm.structured_output.compiler import GrammarCompiler

if TYPE_CHECKING:
    import xgrammar as xgr

logger = init_logger(__name__)


# Phases of a sequence behind a ReasoningGate: thinking (nothing masked), its first
# token (the grammar's first tokens or the thinking's start), then the answer.
_THINKING, _MAY_THINK, _ANSWER = "thinking", "may_think", "answer"


@dataclass
class _SequenceGrammar:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0
    # Set when a sampled token was rejected: the sequence may then only stop.
    rejected: bool = False
    gate: ReasoningGate | None = None
    phase: str = _ANSWER

    def fork(self) -> _SequenceGrammar:
        return _SequenceGrammar(self.matcher.fork(), self.num_accepted, self.rejected, self.gate, self.phase)


class StructuredOutputManager:
    """Compiles constraints at ``add_request`` time and keeps the matchers.

    Safety rules: ``compile`` raises ``ValueError`` and changes nothing, so call
    it before the request enters the scheduler; ``bitmask_for`` and ``accept``
    must see the same SchedulerOutput, in that order, once per step.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._sequences: dict[str, _SequenceGrammar] = {}

    @property
    def num_live_matchers(self) -> int:
        return len(self._sequences)

    def compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """The request's compiled grammar (None when unguided). Raises ValueError
        naming the field for a constraint that cannot be compiled or combined."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if params.ignore_eos:
            raise ValueError("SamplingParams.ignore_eos cannot be combined with structured_outputs: a guided "
                             "output ends with EOS once its grammar is complete; drop ignore_eos")
        if params.min_tokens > 0:
            raise ValueError("SamplingParams.min_tokens cannot be combined with structured_outputs: the grammar "
                             "decides when the output may end; drop min_tokens")
        return self.compiler.compile(constraint)

    def add_sequence(self, sequence_id: str, grammar: xgr.CompiledGrammar, gate: ReasoningGate | None = None) -> None:
        """Guide ``sequence_id`` by ``grammar``; behind ``gate`` only once its thinking ends."""
        import xgrammar as xgr  # loaded on first use (``compiler``'s docstring says why)

        phase = _ANSWER if gate is None else _THINKING if gate.thinking else _MAY_THINK
        self._sequences[sequence_id] = _SequenceGrammar(xgr.GrammarMatcher(grammar), gate=gate, phase=phase)

    def bitmask_for(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The allowed next tokens of every guided sample row of this step, or
        None when no row is guided (the runner then pays nothing)."""
        rows = [
            (row, state)
            for scheduled in scheduler_output.scheduled
            if scheduled.sample_rows and (state := self._sequences.get(scheduled.sequence_id)) is not None
            for row in scheduled.sample_rows
        ]
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for index, (row, state) in enumerate(rows):
            if row.output_position != state.num_accepted:
                raise RuntimeError(
                    f"grammar state of {row.sequence_id!r} covers {state.num_accepted} tokens but the row samples "
                    f"output position {row.output_position} (this is a bug)"
                )
            if state.rejected:
                self._allow_only_eos(bitmask[index])
            elif state.phase == _THINKING:
                bitmask[index].fill_(-1)  # every bit set: the thinking is free text
            else:
                state.matcher.fill_next_token_bitmask(bitmask, index)
                if state.phase == _MAY_THINK:
                    self._allow(bitmask[index], state.gate.start_token_id)
        return GrammarBitmask([row.sequence_id for row, _ in rows], bitmask)

    def accept(self, scheduler_output: SchedulerOutput, sampled: Mapping[str, SampledTokens]) -> None:
        """Advance the matchers by the tokens each guided row got this step (one:
        guided rows never speculate). A row beyond a sequence's first is a
        future fork: it gets a copy of the matcher first."""
        for scheduled in scheduler_output.scheduled:
            parent = self._sequences.get(scheduled.sequence_id)
            if parent is None or not scheduled.sample_rows:
                continue
            for row in scheduled.sample_rows[1:]:
                self._sequences[row.sequence_id] = parent.fork()
            for row in scheduled.sample_rows:
                state = self._sequences[row.sequence_id]
                for token_id in sampled[row.sequence_id].token_ids:
                    self._accept_token(row.sequence_id, state, token_id)

    def retain(self, live_sequence_ids: Container[str]) -> None:
        """Drop the matchers of sequences that ended (finish, stop string, abort)."""
        for sequence_id in [s for s in self._sequences if s not in live_sequence_ids]:
            del self._sequences[sequence_id]

    def _accept_token(self, sequence_id: str, state: _SequenceGrammar, token_id: int) -> None:
        state.num_accepted += 1
        if state.phase == _THINKING:
            if token_id == state.gate.end_token_id:
                state.phase = _ANSWER
            return
        if state.phase == _MAY_THINK:
            state.phase = _ANSWER
            if token_id == state.gate.start_token_id:
                state.phase = _THINKING
                return
        if state.rejected or state.matcher.accept_token(token_id):
            return
        # Only a row whose every token was masked (another constraint, e.g. a
        # token filter, removed all the grammar allowed) can draw a disallowed
        # token; the output can no longer match, so the sequence is made to stop.
        state.rejected = True
        logger.warning("sequence %r sampled token %d, which its grammar does not allow; it will stop",
                       sequence_id, token_id)

    def _allow_only_eos(self, row: torch.Tensor) -> None:
        row.zero_()
        for token_id in self.eos_token_ids:
            self._allow(row, token_id)

    @staticmethod
    def _allow(row: torch.Tensor, token_id: int) -> None:
        """Set ``token_id``'s bit in a bitmask row (int32 words)."""
        word, bit = divmod(token_id, 32)
        value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value  # the int32 with these bits
