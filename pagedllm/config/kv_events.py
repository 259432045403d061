"""``kv_events_config``, spelt as vLLM's ``--kv-events-config``.

A leaf module, torch-free: ``config.engine`` validates the option with it
and the engine builds its publisher (``pagedllm.kv_tiers.events``) from it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how KV cache events are published (vLLM's field names and defaults).

    ``endpoint`` is the PUB socket's: a wildcard host (``tcp://*:5557``,
    ``0.0.0.0``) or an ipc/inproc address is bound, any other connected to (a
    collector that binds), as vLLM does; ``replay_endpoint`` is always bound.
    ``hwm`` is the PUB socket's send high-water mark (0: no limit, as ZMQ's).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null", as vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config: {name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"kv_events_config: replay_endpoint must be a string, got {self.replay_endpoint!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(f"kv_events_config: {name} must be a ZMQ address such as 'tcp://*:5557', "
                                 f"got {value!r}")
        if self.replay_endpoint == self.endpoint:
            raise ValueError(f"kv_events_config: replay_endpoint must differ from endpoint ({self.endpoint!r})")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"kv_events_config: {name} must be an integer >= {least}, got {value!r}")

    @classmethod
    def from_option(cls, value: KVEventsConfig | dict[str, Any] | None) -> KVEventsConfig | None:
        """The option as given by ``LLM(kv_events_config=...)`` or ``--kv-events-config``
        (a dict, as vLLM takes it, or an instance), validated; None when absent or
        events are not enabled."""
        if value is None:
            return None
        if isinstance(value, KVEventsConfig):
            return value if value.enable_kv_cache_events else None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {value!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; the keys are: {', '.join(known)}")
        config = cls(**value)
        return config if config.enable_kv_cache_events else None
