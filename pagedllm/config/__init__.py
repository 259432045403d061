"""Every option group of the engine, in one folder.

``engine.py`` holds ``EngineConfig`` (and its ``SchedulerConfig``), the one object
``LLM(...)``, the command line and the engine-core process are built from; each
nested group lives in a module of its own, torch-free so that ``core/`` can read
it: ``cache.py`` (the pool), ``kv_offload.py`` (host/disk tiers), ``kv_events.py``
(the event publisher), ``lora.py`` and ``speculative.py``. Importing this package
loads no torch (``config.engine`` imports it only inside ``torch_dtype``).
"""

from pagedllm.config.cache import CacheConfig
from pagedllm.config.engine import EngineConfig, SchedulerConfig
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.config.kv_offload import KVOffloadConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.speculative import SpeculativeConfig

__all__ = ["CacheConfig", "EngineConfig", "KVEventsConfig", "KVOffloadConfig", "LoRAConfig",
           "SchedulerConfig", "SpeculativeConfig"]
