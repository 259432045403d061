"""A smaller model with the target's tokenizer proposes drafts.

The draft keeps its own paged KV pool, indexed by the target's block ids, so
it needs no block bookkeeping of its own:

- ``observe`` runs every step the target runs: the same block moves, then the
  draft's forward over the same tokens, positions and slots. Every position
  the target computes, the draft computes in the same step, so whatever the
  draft reads below a sequence's last token is its own K/V of the accepted
  tokens (rejected drafts' positions are rewritten when they are computed again).
- ``propose`` decodes ``k`` tokens greedily from each sequence's closing
  token. The positions past the target's table land in a few scratch blocks
  after the shared ones; positions inside the table land in the sequence's
  own blocks, ahead of anything computed, and are rewritten by the next
  step's ``observe``.

With a hybrid KV layout (several groups, ``core.kv_groups``) the draft follows
group 0's table, the full-attention one, which has an entry for every block:
its layer caches keep ``group`` 0, so they read view 0 of the step's metadata,
and ``propose`` gets group 0's tables. The pool covers every block id, so any
block group 0 is given has its slot here.

Greedy proposals make the draft distribution one-hot, so verification is the
same exact rejection test as for prompt lookup (``worker/spec_decode/rejection.py``).
A stale or clobbered draft K/V (a swapped sequence's, or two samples of a fork
writing ahead in the block they still share) can only lower the acceptance,
never change the output.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.config.engine import EngineConfig, torch_dtype
from pagedllm.attention.selector import attention_backend_for
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.base import CausalLM
from pagedllm.model.loader import load_checkpoint
from pagedllm.model.registry import build_model
from pagedllm.model.rotary import context_window_of
from pagedllm.utils import cdiv
from pagedllm.kv_tiers.block_codec import BlockCodec
from pagedllm.kv_tiers.host import HostKVStore
from pagedllm.worker.block_mover import BlockMover
from pagedllm.worker.block_moves import allocate_caches
from pagedllm.worker.step_inputs import StepInputs

# Sequences proposed for in one batch; the scratch blocks are sized for it.
PROPOSAL_BATCH = 64


def load_draft_model(config: EngineConfig, vocab_size: int, max_model_len: int,
                     device: torch.device) -> CausalLM | None:
    """The draft checkpoint of ``config.speculative_config`` (None without
    one), in the target's dtype, checked against the target: the same
    vocabulary, and a context window that covers ``max_model_len``."""
    speculative = config.speculative
    if speculative is None or speculative.model is None:
        return None
    path = speculative.model
    dtype = torch_dtype(config.dtype)
    checkpoint = load_checkpoint(path, dtype=dtype, gguf_weights=config.gguf_weights)
    if checkpoint.config.vocab_size != vocab_size:
        raise ValueError(f"speculative_config model {path!r} has a vocabulary of {checkpoint.config.vocab_size} "
                         f"tokens, the target {vocab_size}: the draft must share the target's tokenizer")
    window = context_window_of(checkpoint.config)
    if window < max_model_len:
        raise ValueError(f"speculative_config model {path!r} has a context window of {window} tokens, shorter than "
                         f"max_model_len ({max_model_len}); lower max_model_len")
    return build_model(checkpoint, max_model_len, device, dtype, TensorParallelGroup(rank=0, world_size=1))


class DraftModel:
    """The draft model and its pool (``num_blocks`` shared ids, then scratch).

    Safety rule: ``observe`` must see every step the target runs, in order,
    before ``propose`` is called for it.
    """

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 kv_cache_dtype: str, device: torch.device, num_swap_blocks: int, num_tokens: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_tokens = num_tokens
        self.device = device
        self.scratch_per_sequence = cdiv(num_tokens, block_size) + 1
        self.scratch_start = num_blocks
        num_scratch = PROPOSAL_BATCH * self.scratch_per_sequence
        self.kv_caches = allocate_caches(model, num_blocks + num_scratch, block_size, dtype, kv_cache_dtype, device)
        # Its own swap rows for the same host block ids; no tiers and no tails (``BlockMover``).
        self.mover = BlockMover(self.kv_caches, HostKVStore(BlockCodec(self.kv_caches), num_swap_blocks))
        self.attention = attention_backend_for(device, block_size, kv_cache_dtype, dtype=dtype)

    def observe(self, step: StepInputs) -> None:
        """The target's step, on the draft's pool."""
        self.mover.before_forward(step.block_moves)
        if step.input_ids is not None:
            self.model(step.input_ids, step.positions, self.kv_caches, step.metadata, self.attention)

    def propose(self, contexts: list[tuple[list[int], int, int]], num_tokens: list[int]) -> list[list[int]]:
        """Greedy drafts for ``(block table, position, token)`` contexts: the
        sequence's closing token and its position; ``num_tokens[i]`` of them."""
        proposals: list[list[int]] = []
        for start in range(0, len(contexts), PROPOSAL_BATCH):
            chunk = contexts[start : start + PROPOSAL_BATCH]
            drafted = self._propose_batch(chunk, max(num_tokens[start : start + PROPOSAL_BATCH]))
            proposals += [d[:n] for d, n in zip(drafted, num_tokens[start : start + PROPOSAL_BATCH])]
        return proposals

    def _propose_batch(self, contexts: list[tuple[list[int], int, int]], num_tokens: int) -> list[list[int]]:
        bs = self.block_size
        tables = [
            table + list(range(self.scratch_start + i * self.scratch_per_sequence,
                               self.scratch_start + (i + 1) * self.scratch_per_sequence))
            for i, (table, _, _) in enumerate(contexts)
        ]
        positions = [position for _, position, _ in contexts]
        tokens = [token for _, _, token in contexts]
        drafted: list[list[int]] = [[] for _ in contexts]
        for step in range(num_tokens):
            now = [p + step for p in positions]
            width = max(cdiv(p + 1, bs) for p in now)
            metadata = AttentionMetadata(
                slot_mapping=self._tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, now)]),
                num_decodes=len(contexts),
                # Each extended table reaches past its own last position; a shorter
                # sequence's is padded with 0 up to the longest's (read by no query).
                decode_block_tables=self._tensor([t[:width] + [0] * (width - len(t)) for t in tables]),
                decode_context_lens=self._tensor([p + 1 for p in now]),
                prefills=[],
            )
            hidden = self.model(self._tensor(tokens), self._tensor(now), self.kv_caches, metadata, self.attention)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for draft, token in zip(drafted, tokens):
                draft.append(token)
        return drafted

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
