"""What a hybrid KV layout (several KV cache groups, ``core.kv_groups``) does not run.

The refusal names the way back to one group, ``--disable-hybrid-kv-cache-manager``,
which keeps every layer's blocks and runs everything as before groups existed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.kv_groups import KVGroupLayout

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig


def refuse_what_hybrid_groups_cannot_run(config: EngineConfig, groups: KVGroupLayout) -> None:
    """``ValueError`` for what does not run with a hybrid layout (more than one KV
    cache group), naming the way back to one group: the contiguous layout, whose
    one reservation per request is not a table per group (it is the benchmarks'
    baseline of what paging beats, not a serving mode)."""
    if config.cache.kv_layout == "contiguous":
        raise ValueError(f"this model's KV cache is split into {groups.num_groups} groups "
                         f"({'; '.join(group.describe() for group in groups.groups)}), which does not support "
                         "kv_layout='contiguous' (one reservation per request, not a table per group): pass "
                         "--disable-hybrid-kv-cache-manager (disable_hybrid_kv_cache_manager=True) to keep every "
                         "layer's blocks in one group")
