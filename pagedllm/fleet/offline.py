"""``LLM(data_parallel_size=N)``: N engine clients behind one, a router over them.

Each replica is an ``EngineClient`` (``make_engine_client`` starts engine-core
processes: ``EngineCoreProxy``, the engine of ``LLM(engine_process=True)``),
with its own KV pool, built from the same options; ``num_threads``, when unset,
shares the machine's cores among all the ranks of all the replicas.
``add_request`` sends each request to one replica by the router's prefix-aware
policy (``fleet/routing.py``): a prompt goes to the replica that was given its
leading blocks before, unless that replica holds too many more of the prompt
tokens given since the fleet was last idle than the least-loaded one (more than
half an even share of them more, and 1.5 times as many); a prompt sharing
nothing goes to the least-loaded replica. ``step()`` steps every replica with
work (each core computes in its own process, so the replicas run in parallel)
and returns their outputs; request ids are the fleet's, unique across replicas.

Safety rules: one thread calls a fleet (``LLM``'s); a request a replica refuses
raises its ``ValueError`` and is on no replica; ``abort_request`` withdraws from
every replica, so no pool keeps a block of it. ``shutdown()`` stops every
replica (engine-core processes also stop with this process).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pagedllm.config.engine import threads_per_rank
from pagedllm.core.block_hash import hash_request_tokens
from pagedllm.core.prompt_tokens import tokenized
from pagedllm.fleet.prefix_index import PrefixIndex
from pagedllm.fleet.routing import BalanceRule, ReplicaLoad, RoutingPolicy
from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:  # the fleet sees its replicas through the contract only
    from pagedllm.config.pooling import PoolerSpec
    from pagedllm.engine.beam_search import BeamSearchParams
    from pagedllm.engine.client import EngineClient
    from pagedllm.lora.request import LoRARequest
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams

# How long a routed prompt's blocks count as held by its replica (they may be evicted sooner: a hint only).
CLAIM_TTL_S = 600.0
# stats() keys every replica reports alike (the fleet reports replica 0's), and those it reports the largest of;
# every other number is summed.
_SHARED_STATS = frozenset({"block_size", "bytes_per_token", "kv_cache_dtype", "tensor_parallel_size",
                           "min_cacheable_prefix_tokens", "lora_page_elems"})
_MAX_STATS = frozenset({"peak_running_per_step"})


def check_data_parallel_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {value!r}")
    return value


def replica_options(options: dict[str, Any], size: int) -> dict[str, Any]:
    """Each replica's engine options: an unset ``num_threads`` becomes the machine's
    cores // (replicas x tensor_parallel_size), at least 1."""
    threads = threads_per_rank(options.get("num_threads"), options.get("tensor_parallel_size", 1), size)
    return {**options, "num_threads": threads}


class OfflineFleet:
    """An ``EngineClient`` over ``replicas`` (other ``EngineClient``s): each request
    routed to one of them, their answers aggregated."""

    def __init__(self, replicas: list[EngineClient]) -> None:
        self.replicas = replicas
        self.size = len(replicas)
        self.block_size: int = replicas[0].stats()["block_size"]
        self.index = PrefixIndex(claim_ttl_s=CLAIM_TTL_S)
        # The routing load: prompt tokens given to each replica since the fleet was last idle
        # (``LLM`` queues a call's prompts, then steps until all are done), and their replicas.
        self._policy = RoutingPolicy("prefix")
        self._loads = [0] * self.size
        self.last_assignment: list[int] = []  # the replica of each request since the fleet was last idle
        self._ids = itertools.count()

    @classmethod
    def start(cls, start_replica: Callable[[], EngineClient], size: int) -> OfflineFleet:
        """A fleet of ``size`` replicas from ``start_replica``, started concurrently (the
        cores load at once); if one fails, the others are shut down and its error raised."""
        with ThreadPoolExecutor(size, thread_name_prefix="pagedllm-dp-start") as pool:
            starts = [pool.submit(start_replica) for _ in range(size)]
        replicas = [start.result() for start in starts if start.exception() is None]
        failed = [start.exception() for start in starts if start.exception() is not None]
        if failed:
            for replica in replicas:
                replica.shutdown()
            raise failed[0]
        return cls(replicas)

    # ------------------------------------------------------------ requests

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: Any,
                    params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Route the request to a replica and queue it there (its ``ValueError`` if it refuses)."""
        # text is encoded (and images processed) once, here
        prepared = tokenized(self.get_tokenizer(), prompt, self.get_image_processor())
        replica = self._route(prepared, cache_salt)
        self.replicas[replica].add_request(request_id, prepared, params, priority=priority, cache_salt=cache_salt,
                                           lora_request=lora_request)

    def _route(self, prompt: Any, cache_salt: str | None) -> int:
        """The replica of a prompt: prefix-aware, balancing the prompt tokens given since the fleet was idle."""
        if not self.has_unfinished_requests():
            self._policy, self._loads, self.last_assignment = RoutingPolicy("prefix"), [0] * self.size, []
        ids = _token_ids(prompt)
        self._policy.balance = BalanceRule(balance_abs_threshold=(sum(self._loads) + len(ids)) / self.size / 2)
        spans = [feature.span for feature in prompt.get("mm_features") or ()] if isinstance(prompt, dict) else []
        hashes = hash_request_tokens(ids, self.block_size, cache_salt or _cache_salt(prompt), mm_spans=spans)
        loads = [ReplicaLoad(r, self._loads[r]) for r in range(self.size)]
        replica = self._policy.choose(loads, hashes, self.index, time.monotonic()).replica
        self._loads[replica] += len(ids)
        self.last_assignment.append(replica)
        return replica

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        for replica in self.replicas:
            replica.abort_request(request_id)  # each withdraws only its own

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def step(self) -> list[RequestOutput]:
        """A step of every replica with work, their outputs in replica order. The cores
        compute concurrently in their processes; this collects each one's next step."""
        return [output for replica in self.replicas if replica.has_unfinished_requests()
                for output in replica.step()]

    # ----------------------------------------- answers over every replica

    def get_tokenizer(self):
        return self.replicas[0].get_tokenizer()

    def get_image_processor(self):
        return self.replicas[0].get_image_processor()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].get_default_sampling_params()

    @property
    def pooler_spec(self) -> PoolerSpec | None:  # what a pooling fleet's replicas pool (all alike)
        return self.replicas[0].pooler_spec

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    def stats(self) -> dict:
        return merge_stats([replica.stats() for replica in self.replicas])

    def kv_pool_snapshot(self) -> dict:
        return {"data_parallel_size": self.size, "replicas": [replica.kv_pool_snapshot() for replica in self.replicas]}

    def reset_prefix_cache(self) -> int:
        dropped = sum(replica.reset_prefix_cache() for replica in self.replicas)
        for replica in range(self.size):
            self.index.cleared(replica)
        return dropped

    def reset_peak_blocks_in_use(self) -> None:
        for replica in self.replicas:
            replica.reset_peak_blocks_in_use()

    def check_invariants(self) -> None:
        for replica in self.replicas:
            replica.check_invariants()

    @property
    def step_timings(self) -> dict[str, float]:
        summed: dict[str, float] = {}
        for replica in self.replicas:
            for phase, seconds in replica.step_timings.items():
                summed[phase] = summed.get(phase, 0.0) + seconds
        return summed

    def reset_step_timings(self) -> None:
        for replica in self.replicas:
            replica.reset_step_timings()

    def weight_bytes(self) -> int:
        return sum(replica.weight_bytes() for replica in self.replicas)

    def capacity_line(self) -> str:
        return "\n".join(f"replica {i}: {replica.capacity_line()}" for i, replica in enumerate(self.replicas))

    def metrics_registry(self) -> _ReplicaMetrics:
        return _ReplicaMetrics([replica.metrics_registry() for replica in self.replicas])

    def shutdown(self) -> None:
        """Stop every replica. Safe to call twice."""
        for replica in self.replicas:
            replica.shutdown()


class _ReplicaMetrics:
    """The replicas' metric families (what ``get_metrics_snapshot`` walks), each series
    labelled ``engine`` with its replica's index, as vLLM labels data-parallel ranks."""

    def __init__(self, registries: list[Any]) -> None:
        self._registries = registries

    def collect(self):
        for replica, registry in enumerate(self._registries):
            for family in registry.collect():
                family.samples = [sample._replace(labels={**sample.labels, "engine": str(replica)})
                                  for sample in family.samples]
                yield family


def merge_stats(per_replica: list[dict]) -> dict:
    """One ``stats()`` for the fleet: counts summed, per-replica constants kept once,
    peaks the largest, averages and rates recomputed from the summed counts."""
    merged: dict[str, Any] = {}
    for key, first in per_replica[0].items():
        values = [stats[key] for stats in per_replica if key in stats]
        if key in _SHARED_STATS or isinstance(first, str):
            merged[key] = first
        elif isinstance(first, bool):
            merged[key] = all(values)
        elif key in _MAX_STATS:
            merged[key] = max(values)
        else:
            merged[key] = sum(values)
    merged["mean_running_per_step"] = merged["num_scheduled_sequences"] / max(1, merged["num_steps"])
    if "spec_acceptance_rate" in merged:
        merged["spec_acceptance_rate"] = merged["spec_num_accepted_tokens"] / max(1, merged["spec_num_draft_tokens"])
    merged["data_parallel_size"] = len(per_replica)
    return merged


def _token_ids(prompt: Any) -> list[int]:
    """A prompt's token ids for routing (after ``tokenized``); [] for one the replica will refuse."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    if isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return list(ids)
    return []


def _cache_salt(prompt: Any) -> str | None:
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    return salt if isinstance(salt, str) and salt else None
