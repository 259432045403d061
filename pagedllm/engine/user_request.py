"""The one protocol the engine's two request kinds share.

A user request in the engine's registry is either a sampled request
(``output_processor.RequestState``: its sequences' tokens become text each
step) or a beam search (``beam_search.BeamGroup``: it ranks hypotheses and
reports once, when done). The engine, its stats and its clients read them only
through ``UserRequest``, so a new kind (a pooling request) is one more class
here, not a branch in each reader; ``tests/test_code_limits.py`` checks that
nothing outside the kinds' own modules asks which kind it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from pagedllm.outputs import RequestMetrics, RequestOutput


class UserRequest(Protocol):
    """One live user request, however many sequences it runs as.

    Safety rule: the engine's thread alone reads and changes it (between
    steps, or in a step's bookkeeping)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any  # its SamplingParams or BeamSearchParams: max_tokens is read from either
    metrics: RequestMetrics
    # True: the output processor folds its sequences' tokens into text (and stop
    # strings) each step. False: it reports itself (``own_output``) once done.
    streams_tokens: ClassVar[bool]

    @property
    def num_completions(self) -> int:
        """How many completions the user asked for (``n``, or ``beam_width``)."""

    def live_sequence_ids(self) -> list[str]:
        """Ids of every sequence it may still have in the scheduler (what an abort finishes)."""

    def output_lengths(self) -> list[int]:
        """Tokens generated so far per reported sequence (an abort's metrics); [] when none are reported."""

    def own_output(self, tokenizer: Any) -> RequestOutput | None:
        """The output it reports by itself after a step: a finished search's one output;
        None until then, and always for a kind whose tokens the output processor reports."""
