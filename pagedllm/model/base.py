"""``CausalLM``: what the rest of the engine may use of a model.

The runner, the CUDA graphs, the KV pool's sizing and allocation, and the
speculative draft model name this protocol, never a model class, so a new
architecture is a new class in ``model/`` plus a line in ``model/registry.py``.
``LlamaForCausalLM``, ``GemmaForCausalLM`` and ``Cohere2ForCausalLM`` implement it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
    from pagedllm.attention.kv_cache import LayerKVCache


@runtime_checkable
class CausalLM(Protocol):
    """One rank's shard of a decoder-only language model over a paged KV pool.

    Shape facts (read to size and allocate the pool, one layer cache per layer):
    ``config`` is the Hugging Face config of the whole model
    (``num_hidden_layers``, head size via ``model.shapes.head_dim_of``, vocabulary),
    and ``num_kv_heads`` the KV heads this rank stores (all of them with one rank).

    Safety rules: ``__call__`` writes each new token's K/V of a layer into
    ``kv_caches`` at ``metadata.slot_mapping`` (and, int8 tails, at
    ``metadata.tail_write_slots``) before any query of that layer reads it, and
    writes nowhere else in the pool: the padded rows of a CUDA graph and every
    block table the runner follows rely on it. ``rope_depends_on_length``
    must be True when the forward decides anything on the host from the
    sequences' lengths: a captured graph would replay the first decision.
    """

    config: PretrainedConfig
    num_kv_heads: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The final hidden states ``[num_tokens, hidden]`` of a flattened step
        (every scheduled token of every sequence, in ``metadata``'s order)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` in the model's dtype for the hidden rows
        given: callers pass only the rows they sample or score."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take Hugging Face-named weights of the whole model (this rank's
        shard is cut out), assigning, not copying; consumes ``state_dict``.
        ``model.registry.build_model`` calls it on a model built on the meta device."""
        ...

    @property
    def rope_depends_on_length(self) -> bool:
        """Whether rotary frequencies change with the sequence length (dynamic
        NTK, LongRoPE): such a forward cannot be captured in a CUDA graph."""
        ...
