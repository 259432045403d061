"""The engine's adapters by name: a ``LoRARequest`` checked once against the base
model and turned into the ``AdapterSpec`` the scheduler pages."""

from __future__ import annotations

from typing import Any

from pagedllm.core.adapter_spec import AdapterSpec
from pagedllm.lora.adapter_files import adapter_fingerprint, read_adapter
from pagedllm.lora.page_layout import pages_on_every_rank
from pagedllm.lora.request import LoRARequest


class AdapterRegistry:
    """Validates adapters and remembers them by name.

    Safety rule: an adapter is read whole and checked (files, shapes, rank, targets)
    the first time its name is seen, before any request of it reaches the scheduler,
    so a bad adapter is a ``ValueError`` for that request alone. A name keeps its path
    until ``forget``: the same name with another path is refused, since the name is
    what keys its prefix-cache blocks and its pages.
    """

    def __init__(self, model_config: Any, max_lora_rank: int, page_elems: int, num_blocks: int,
                 tensor_parallel_size: int = 1, num_kv_groups: int = 1) -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.page_elems = page_elems  # rank 0's
        self.num_blocks = num_blocks
        self.tensor_parallel_size = tensor_parallel_size
        self.num_kv_groups = num_kv_groups  # the pool's KV cache groups: a stretch of pages each
        self.specs: dict[str, AdapterSpec] = {}

    def spec_for(self, lora_request: LoRARequest) -> AdapterSpec:
        """The request's adapter, checked (``ValueError`` naming what to change)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a pagedllm.LoRARequest, got {type(lora_request).__name__}")
        name, path = lora_request.lora_name, lora_request.lora_path
        known = self.specs.get(name)
        if known is not None:
            if known.path != path:
                raise ValueError(f"LoRA adapter {name!r} is already loaded from {known.path!r}; give the adapter at "
                                 f"{path!r} another name (or unload {name!r} first)")
            return known
        weights = read_adapter(path, self.model_config, self.max_lora_rank)
        num_pages = pages_on_every_rank(weights.rank, weights.target_modules, self.model_config,
                                        self.tensor_parallel_size, self.page_elems, self.num_kv_groups)
        if num_pages > self.num_blocks:
            raise ValueError(f"LoRA adapter {name!r} needs {num_pages} KV blocks of pages but the pool has "
                             f"{self.num_blocks}; enlarge the pool (kv_cache_memory / num_kv_blocks)")
        spec = self.specs[name] = AdapterSpec(name, path, num_pages, adapter_fingerprint(path))
        return spec

    def forget(self, name: str) -> bool:
        """Drop a name (its resident pages are evicted as they are needed); False if unknown."""
        return self.specs.pop(name, None) is not None
