"""How many full-precision tail slots an int8 pool keeps (``pagedllm.worker.tail_slots``).

A running sequence holds a slot per KV cache group for the block it is
filling, plus those one step's draft tokens can reach past it
(``TailPlan.per_sequence``); the pool wants that for ``max_num_seqs``
sequences. A slot costs a block of the model's dtype (3.76x an int8 block of
SmolLM2 in fp32), so a byte budget that paid for every sequence's slot spent
most of itself on tails: at 64 MiB, 71 int8 blocks and 71 slots held 1,136
tokens against fp32's 1,456.

Safety rule (``within_share``): a byte budget gives the tails at most half of
what int8 saves over the model dtype, in whole sequences' slots and at least
one sequence's; the scheduler then runs at most ``max_running`` sequences
(``PoolPlan.max_running_seqs``), so every running sequence still finds its
slots and reads its partial blocks at full precision. int8 then holds the mean
of the model dtype's and a tail-free int8 pool's tokens, more than the model
dtype in every budget of more than ~1.4 slots (1 MiB for SmolLM2 in fp32). ``num_kv_blocks`` is an exact
block count with its tails on top and is not cut. A prefill chunk that leaves
one partial block for another hands its slot on, so holds one; should every
slot still be taken, a block reads as int8 (``tail_slots``), never an error.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.utils import cdiv


class TailPlan(NamedTuple):
    """An int8 pool's tail slots (``num_slots`` 0: no tails, the pool is not int8)."""

    per_sequence: int  # slots one running sequence holds
    num_slots: int
    bytes_per_slot: int  # a block of the model's dtype, of a block's layers

    @property
    def max_running(self) -> int:
        """The most sequences whose slots the pool holds."""
        return self.num_slots // self.per_sequence


NO_TAILS = TailPlan(1, 0, 0)


def tail_plan(max_num_seqs: int, block_size: int, num_speculative_tokens: int, num_groups: int,
              bytes_per_slot: int) -> TailPlan:
    """The slots ``max_num_seqs`` sequences want: one per group for the block each is
    filling, plus those one step's draft tokens can reach past it."""
    per_sequence = num_groups * (1 + cdiv(num_speculative_tokens, block_size))
    return TailPlan(per_sequence, per_sequence * max_num_seqs, bytes_per_slot)


def within_share(tails: TailPlan, budget: int, quantized_ratio: float) -> TailPlan:
    """``tails`` cut to a byte ``budget``'s share (the module's safety rule);
    ``quantized_ratio``: an int8 token's bytes over the model dtype's."""
    share = budget * (1 - quantized_ratio) / 2
    sequences = max(1, int(share // (tails.per_sequence * tails.bytes_per_slot)))
    return tails._replace(num_slots=min(tails.num_slots, sequences * tails.per_sequence))
