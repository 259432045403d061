"""What the scheduler hands the model runner each step: plain data, no live objects.

The runner keeps its own copy of every sequence it has seen (token ids, block
table, sampling settings), built from ``NewSequenceData`` the first time a
sequence is scheduled (or scheduled again after a preemption) and advanced by
the diffs in ``ScheduledSequence`` after that. It never reads a ``Request``, so
a persistent input batch, CUDA graphs or a worker in another process consume
the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.block_moves import BlockMovePlan
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    """One token to sample from a sequence's last logits.

    A sequence about to fork into ``n`` samples gets ``n`` rows over the same
    logits: row ``i`` is sampled for ``sequence_id`` (the sequence itself for
    ``i = 0``, else the id its fork will have) with that sample's own ``seed``.
    ``output_position`` is the index in the output of the token being drawn,
    which with the seed fixes the row's randomness.
    """

    sequence_id: str
    seed: int
    output_position: int


@dataclass
class NewSequenceData:
    """Everything the runner must know about a sequence it has not seen, or
    must forget and relearn (resumed after a preemption, a fresh fork).

    Safety rule: ``prompt_token_ids`` is shared with the scheduler and never
    changes; ``output_token_ids`` and ``block_ids`` are the runner's own copies.
    ``block_ids`` holds one table per KV cache group, in group order, all of one
    length (``NULL_BLOCK_ID`` for an entry a sliding window released).
    """

    sequence_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[list[int]]
    sampling_params: SamplingParams
    # The LoRA adapter it runs under (None: the base); its pages are resident while it runs.
    lora_name: str | None = None
    # A pooling sequence (task set): its sample row is pooled, not sampled.
    pooling_params: PoolingParams | None = None
    # Images in its prompt (``multimodal/inputs.py``): the runner embeds them at their placeholders.
    mm_features: tuple = ()


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: compute its tokens
    ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``.

    Diffs against what the runner holds (empty for a sequence in
    ``new_sequences`` this step): ``new_token_ids`` were appended since it last
    ran, ``new_block_ids`` extend its block tables (one list per KV cache
    group, all of one length; ``[]`` when the tables did not grow), and
    ``replaced_blocks`` are ``(group, table index, block id)`` entries a
    copy-on-write replaced, or that a sliding window released (block id
    ``NULL_BLOCK_ID``). Applied in the order the fields are listed, after
    ``truncated_table_length`` (which cuts every group's table).
    """

    sequence_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    replaced_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    # Not None when a speculative rollback freed the table's tail since the
    # runner last saw it: cut the table to this many entries first, then
    # replace and extend as above.
    truncated_table_length: int | None = None
    # Empty for a prefill chunk that stops short of the last known token.
    sample_rows: list[SampleRow] = field(default_factory=list)
    # Speculative decoding. ``draft_token_ids`` are the last
    # ``len(draft_token_ids)`` tokens of this step's span: proposed, not known.
    # The runner feeds them after the sequence's known tokens, verifies them
    # against its own samples and returns the accepted ones; they never join
    # its copy of the sequence (the accepted ones come back as
    # ``new_token_ids`` of the next step). ``num_draft_tokens`` is how many
    # tokens the runner should propose after this step for the next (0: none).
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    """What the model runner executes this step.

    The runner first forgets ``released_sequence_ids`` (finished, aborted or
    preempted since it last heard), then learns ``new_sequences``, then applies
    the diffs of ``scheduled``. It carries out ``block_moves`` in the order
    ``core.block_moves.Phase`` states, around the forward pass.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    new_sequences: list[NewSequenceData] = field(default_factory=list)
    released_sequence_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Copy-on-write copies (and forks when block sharing is off), swaps and the
    # tiers' moves. Copies and swaps are group-agnostic: moving block b moves its
    # row in every slot cache.
    block_moves: BlockMovePlan = field(default_factory=BlockMovePlan)
    # An int8 pool's tail slots the requests took and gave back since the last
    # output (``core/kv_managers/tail_runs.py``); the runner applies those given back first.
    tails_taken: list[int] = field(default_factory=list)
    tails_returned: list[int] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
