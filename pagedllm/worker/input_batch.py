"""The persistent input batch: what the runner holds of every live sequence.

Each sequence the scheduler has sent owns one row of preallocated host arrays
(token ids, block tables, their lengths) for as long as the runner holds it.
A hybrid KV layout (``core.kv_groups``) gives a sequence one block table per
group, all of one length (entries aligned by logical block index): the tables
are ``block_table[group, row]``, and each step's slots are gathered per group.
A step applies the scheduler's diffs to those rows (tokens appended, blocks
added, replaced or truncated) and then gathers the step's inputs (token ids,
positions, slots, decode block tables) from them with a few vectorized
indexing operations, instead of rebuilding python lists every step.

Safety rules: a row's entries past its table length are 0 (the padding the
decode block tables have always had), so a released or truncated table never
leaves a stale block id behind; draft tokens are written past the row's known
tokens and never counted in them, so the next step's appended tokens
overwrite them. The arrays grow (doubling) when a sequence outgrows them, so
sizing them by ``max_num_seqs`` / ``max_model_len`` is a hint, not a limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.core.scheduler_output import NewSequenceData, ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv


class CachedSequence:
    """What the sampler reads of one sequence (python lists, as the sampling
    code wants them), its batch row, and how many tokens and table entries the
    row holds (python ints: per-sequence numpy scalar updates cost more than
    the whole vectorized gather)."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "sampling_params", "row", "num_tokens", "num_blocks",
                 "num_computed", "num_written", "lora_name", "pooling_params", "prompt_states", "mm_features",
                 "mrope")

    def __init__(self, data: NewSequenceData, row: int) -> None:
        # The lists are the runner's own (NewSequenceData's safety rule): no copy.
        self.prompt_token_ids = data.prompt_token_ids  # never changes
        self.output_token_ids = data.output_token_ids
        self.sampling_params: SamplingParams = data.sampling_params
        self.lora_name = data.lora_name  # its LoRA adapter (None: the base)
        self.mm_features = data.mm_features  # images in its prompt (``worker/multimodal_embeds.py``)
        self.mrope = None  # an M-RoPE model's prompt positions and delta (``worker/mrope.py``)
        # A pooling sequence: what it returns, and (encode) its prompt chunks' final
        # hidden states so far, dropped with the sequence when it is released.
        self.pooling_params = data.pooling_params
        self.prompt_states: list = []
        self.row = row
        self.num_tokens = len(data.prompt_token_ids) + len(data.output_token_ids)  # drafts excluded
        self.num_blocks = 0
        # Tokens in the pool before, and written by, the latest step that
        # scheduled it, drafts included (the runner keeps its tails by them:
        # ``pagedllm.worker.tail_slots``).
        self.num_computed = self.num_written = 0


@dataclass
class StepArrays:
    """One step's flattened inputs, in the order the spans were given."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mappings: np.ndarray  # [num_groups, num_tokens] int64: each token's slot in each group's blocks
    last_rows: np.ndarray  # [num_spans]: index of each span's last token
    context_lens: np.ndarray  # [num_spans]: tokens in each span's context after this step
    num_blocks: np.ndarray  # [num_spans]: table entries each span's context covers

    @property
    def slot_mapping(self) -> np.ndarray:
        """[num_tokens]: group 0's slots (every layer's with one group)."""
        return self.slot_mappings[0]


class InputBatch:
    """Rows of token ids and block tables, one per live sequence (see the module doc)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, num_groups: int = 1) -> None:
        if max_num_seqs < 1 or max_model_len < 1 or block_size < 1 or num_groups < 1:
            raise ValueError("max_num_seqs, max_model_len, block_size and num_groups must be >= 1")
        self.block_size = block_size
        self.num_groups = num_groups
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        # [group, row, entry]: each group's table of each row.
        self.block_table = np.zeros((num_groups, max_num_seqs, cdiv(max_model_len, block_size)), dtype=np.int64)
        self.sequences: dict[str, CachedSequence] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: low rows first

    # ----------------------------------------------------------- the diffs

    def add(self, data: NewSequenceData) -> CachedSequence:
        """Learn a sequence (new, resumed after a preemption, or a fresh fork)."""
        self._check_groups(data.block_ids)
        if data.sequence_id in self.sequences:
            self.release(data.sequence_id)
        if not self._free_rows:
            self._grow(rows=2 * self.token_ids.shape[0])
        sequence = CachedSequence(data, self._free_rows.pop())
        self.sequences[data.sequence_id] = sequence
        self._reserve_tokens(sequence.num_tokens)
        self.token_ids[sequence.row, : len(data.prompt_token_ids)] = data.prompt_token_ids
        self.token_ids[sequence.row, len(data.prompt_token_ids) : sequence.num_tokens] = data.output_token_ids
        self._append_blocks(sequence, data.block_ids)
        return sequence

    def release(self, sequence_id: str) -> None:
        """Forget a sequence (unknown ids are ignored: it may never have run)."""
        sequence = self.sequences.pop(sequence_id, None)
        if sequence is not None:
            self.block_table[:, sequence.row, : sequence.num_blocks] = 0
            self._free_rows.append(sequence.row)

    def apply(self, step: list[ScheduledSequence]) -> None:
        """Advance held sequences by one step's diffs: truncate each table
        (speculative rollback), append new tokens, replace and extend table
        entries, write drafts past the known tokens. The step's tokens are
        written in one vectorized assignment. A truncation or drafts that do
        not fit a sequence raise ``ValueError`` before anything changes.
        Truncations apply to every group's table, replacements name their group."""
        for scheduled in step:
            if scheduled.truncated_table_length is not None or scheduled.draft_token_ids:
                self._check(scheduled)
            if scheduled.new_block_ids:
                self._check_groups(scheduled.new_block_ids)
        rows: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        for scheduled in step:
            sequence = self.sequences[scheduled.sequence_id]
            new = scheduled.new_token_ids
            if new:
                sequence.output_token_ids.extend(new)
                rows += [sequence.row] * len(new)
                positions += range(sequence.num_tokens, sequence.num_tokens + len(new))
                tokens += new
                sequence.num_tokens += len(new)
            length = scheduled.truncated_table_length
            if length is not None:
                self.block_table[:, sequence.row, length : sequence.num_blocks] = 0
                sequence.num_blocks = length
            for group, index, block_id in scheduled.replaced_blocks:
                self.block_table[group, sequence.row, index] = block_id
            if scheduled.new_block_ids:
                self._append_blocks(sequence, scheduled.new_block_ids)
            if scheduled.draft_token_ids:
                rows += [sequence.row] * len(scheduled.draft_token_ids)
                positions += range(sequence.num_tokens, sequence.num_tokens + len(scheduled.draft_token_ids))
                tokens += scheduled.draft_token_ids
        if tokens:
            self._reserve_tokens(max(positions) + 1)
            self.token_ids[rows, positions] = tokens

    def _check(self, scheduled: ScheduledSequence) -> None:
        """A truncation within the held table, drafts right after the known
        tokens (this step's included) in a span longer than the drafts."""
        sequence = self.sequences[scheduled.sequence_id]
        length = scheduled.truncated_table_length
        if length is not None and not 0 <= length <= sequence.num_blocks:
            raise ValueError(f"truncated_table_length {length} of {scheduled.sequence_id} must be within "
                             f"its table of {sequence.num_blocks} entries")
        num_known = sequence.num_tokens + len(scheduled.new_token_ids)
        num_drafts = len(scheduled.draft_token_ids)
        first = scheduled.num_computed_tokens + scheduled.num_scheduled_tokens - num_drafts
        if num_drafts and (first != num_known or num_drafts >= scheduled.num_scheduled_tokens):
            raise ValueError(f"the drafts of {scheduled.sequence_id} must directly follow its "
                             f"{num_known} known tokens within a span of more than "
                             f"{num_drafts} tokens, got span [{scheduled.num_computed_tokens}, "
                             f"{scheduled.num_computed_tokens + scheduled.num_scheduled_tokens})")

    def _reserve_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.token_ids.shape[1]:
            self._grow(tokens=num_tokens)

    def _check_groups(self, block_ids: list[list[int]]) -> None:
        """One list of block ids per group (numpy would broadcast one list over every group's table)."""
        if len(block_ids) != self.num_groups:
            raise ValueError(f"block ids of {len(block_ids)} groups for a batch of {self.num_groups}")

    def _append_blocks(self, sequence: CachedSequence, block_ids: list[list[int]]) -> None:
        """Extend every group's table by its list (one per group, of one length)."""
        end = sequence.num_blocks + len(block_ids[0])
        if end > self.block_table.shape[2]:
            self._grow(blocks=end)
        self.block_table[:, sequence.row, sequence.num_blocks : end] = block_ids
        sequence.num_blocks = end

    def _grow(self, rows: int = 0, tokens: int = 0, blocks: int = 0) -> None:
        """Reallocate to at least these sizes (doubling, so growth is rare)."""
        old_rows, old_tokens = self.token_ids.shape
        old_blocks = self.block_table.shape[2]
        new_rows = max(rows, old_rows)
        new_tokens = max(tokens, 2 * old_tokens) if tokens > old_tokens else old_tokens
        new_blocks = max(blocks, 2 * old_blocks) if blocks > old_blocks else old_blocks
        self.token_ids = _resized(self.token_ids, new_rows, new_tokens)
        self.block_table = _resized(self.block_table, self.num_groups, new_rows, new_blocks)
        self._free_rows[:0] = range(new_rows - 1, old_rows - 1, -1)

    # ------------------------------------------------------------ the step

    def block_ids(self, sequence_id: str, group: int = 0) -> list[int]:
        """A held sequence's block table of ``group``."""
        sequence = self.sequences[sequence_id]
        return self.block_table[group, sequence.row, : sequence.num_blocks].tolist()

    def gather(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> StepArrays:
        """The inputs of spans ``[starts[i], starts[i] + counts[i])`` of ``rows[i]``,
        back to back (drafts included: they sit right after the known tokens);
        each token's slot in every group."""
        ends = starts + counts
        last_rows = np.cumsum(counts) - 1
        span_of_token = np.repeat(np.arange(len(rows)), counts)
        # Each token's offset in its span: its index minus its span's first index.
        offsets = np.arange(int(counts.sum())) - np.repeat(last_rows + 1 - counts, counts)
        positions = starts[span_of_token] + offsets
        token_rows = rows[span_of_token]
        blocks = self.block_table[:, token_rows, positions // self.block_size]
        return StepArrays(
            input_ids=self.token_ids[token_rows, positions].astype(np.int64),
            positions=positions,
            slot_mappings=blocks * self.block_size + positions % self.block_size,
            last_rows=last_rows,
            context_lens=ends,
            num_blocks=-(-ends // self.block_size),
        )

    def decode_tables(self, rows: np.ndarray, width: int, group: int = 0) -> np.ndarray:
        """The first ``width`` entries of each row's table of ``group`` (0 past a row's table)."""
        if width > self.block_table.shape[2]:
            self._grow(blocks=width)
        return self.block_table[group, rows, :width]


def _resized(array: np.ndarray, *shape: int) -> np.ndarray:
    """A zero-padded copy of ``array`` with the (larger or equal) ``shape``."""
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown
