"""What runs beside the KV pool: the tiers below it and the KV event publisher.

Built once the runner's pool exists (the tiers copy its blocks); the KV
manager receives the tiers' index and the event log, the runner their stores.
"""

from __future__ import annotations

import time

from pagedllm.config.engine import EngineConfig
from pagedllm.core.kv_events import KVEventLog
from pagedllm.core.tier_index import TierIndex
from pagedllm.config.kv_events import KVEventsConfig
from pagedllm.kv_tiers.setup import KVTiers, build_kv_tiers
from pagedllm.worker.model_runner import ModelRunner


class KVChannels:
    def __init__(self, config: EngineConfig, runner: ModelRunner, model_path: str, block_size: int) -> None:
        events_config = KVEventsConfig.from_option(config.kv_events_config)
        # What the pool and the tiers record, drained to the publisher once a step.
        self.events = KVEventLog() if events_config is not None else None
        self.tiers: KVTiers | None = build_kv_tiers(config, runner.host_store, model_path, block_size, self.events,
                                                    runner.kv_groups)
        if self.tiers is not None:
            runner.attach_tiers(self.tiers.runner)
        self.publisher = None
        if events_config is not None:
            from pagedllm.kv_tiers.events import make_event_publisher  # zmq is imported only when asked for

            self.publisher = make_event_publisher(events_config)

    @property
    def tier_index(self) -> TierIndex | None:
        return self.tiers.index if self.tiers is not None else None

    def publish(self) -> None:
        """Hand the events recorded since the last call to the publisher (its thread sends them)."""
        if self.publisher is not None:
            events = self.events.take()
            if events:
                self.publisher.publish(events)

    def wait_for_disk(self) -> bool:
        """When nothing could be scheduled: whether that is because requests wait
        for their prefix from disk (then give the reader a moment)."""
        index = self.tier_index
        if index is None or not index.fetching:
            return False
        if not index.wait_landed():
            time.sleep(0.001)
        return True

    def describe(self, pool_line: str) -> str:
        return pool_line if self.tiers is None else f"{pool_line}. {self.tiers.describe()}"

    def shutdown(self) -> None:
        """Finish the disk tier's queued writes, send the last events, stop the publisher."""
        if self.tiers is not None:
            self.tiers.runner.shutdown()
        if self.publisher is not None:
            self.publish()
            self.publisher.shutdown()
