"""``LLM(data_parallel_size=N)``: N engine-core processes behind one offline ``LLM``.

Each replica is an ``EngineCoreProxy`` (the engine of ``LLM(engine_process=True)``)
with its own KV pool, built from the same options; ``num_threads``, when unset,
shares the machine's cores among all the ranks of all the replicas. A call of
``generate`` / ``chat`` / ``beam_search`` is split by the router's prefix-aware
policy (``fleet/routing.py``): a prompt goes to the replica that was given its
leading blocks before (this call or an earlier one), unless that replica holds
too many more of this call's prompt tokens than the least-loaded one (more than
half an even share more, and 1.5 times as many); a prompt sharing nothing goes to
the least-loaded replica. Then one thread per replica steps it (each core
computes in its own process, so the replicas run in parallel) and the final
outputs come back in prompt order, with request ids unique across replicas.

Safety rules: one thread calls a fleet (``LLM``'s); ``run`` joins its stepping
threads before it returns or raises, and on any error (a refused prompt, a dead
core, an interrupt) withdraws what it queued on every replica, so no pool keeps
a block of it. ``shutdown()`` stops every core (they also stop with this process).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedllm.config.engine import threads_per_rank
from pagedllm.core.block_hash import hash_request_tokens
from pagedllm.fleet.prefix_index import PrefixIndex
from pagedllm.fleet.routing import BalanceRule, ReplicaLoad, RoutingPolicy
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine-core client (zmq) is imported when a fleet starts, not with LLM
    from pagedllm.engine.core_proxy import EngineCoreProxy

# add(replica, request id, prompt, index of the prompt): queue one request on that replica (``LLM``'s closure).
AddRequest = Callable[["EngineCoreProxy", str, Any, int], None]

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
    """The engine of an ``LLM`` with ``data_parallel_size`` > 1: ``size`` engine-core
    replicas, with the engine methods ``LLM`` reads aggregated over them."""

    def __init__(self, engine_options: dict[str, Any], size: int) -> None:
        from pagedllm.engine.core_proxy import EngineCoreProxy

        options = replica_options(engine_options, check_data_parallel_size(size))
        with ThreadPoolExecutor(size, thread_name_prefix="pagedllm-dp-start") as pool:
            starts = [pool.submit(EngineCoreProxy, options) for _ in range(size)]  # the cores load concurrently
        self.replicas: list[EngineCoreProxy] = [start.result() for start in starts if start.exception() is None]
        failed = [start.exception() for start in starts if start.exception() is not None]
        if failed:
            self.shutdown()
            raise failed[0]
        self.size = size
        self.block_size: int = self.replicas[0].stats()["block_size"]
        self.index = PrefixIndex(claim_ttl_s=CLAIM_TTL_S)
        self.last_assignment: list[int] = []  # the replica of each prompt of the last run
        self._ids = itertools.count()

    # ------------------------------------------------------------ running

    def run(self, prompts: Sequence[Any], add: AddRequest, use_tqdm: bool) -> list[RequestOutput]:
        """Route ``prompts``, queue each with ``add`` on its replica, step every replica
        until all finish; the final outputs in prompt order. A refused prompt raises
        its ``ValueError`` after this call's other requests are withdrawn everywhere."""
        from pagedllm.engine.core_client import tokenized

        tokenizer = self.get_tokenizer()
        prepared = [tokenized(tokenizer, prompt) for prompt in prompts]  # text is encoded once, here
        self.last_assignment = assignment = self._route(prepared)
        request_ids = [str(next(self._ids)) for _ in prepared]
        finished: dict[str, RequestOutput] = {}
        try:
            for i, (request_id, replica) in enumerate(zip(request_ids, assignment)):
                add(self.replicas[replica], request_id, prepared[i], i)
            self._step_all(len(request_ids), finished, use_tqdm)
        finally:
            unfinished = [request_id for request_id in request_ids if request_id not in finished]
            for replica in self.replicas:
                replica.abort_request(unfinished)  # each withdraws only its own
        return [finished[request_id] for request_id in request_ids]

    def _route(self, prompts: list[Any]) -> list[int]:
        """The replica of each prompt: prefix-aware, load = prompt tokens given so far in this call."""
        token_ids = [_token_ids(prompt) for prompt in prompts]
        total = sum(len(ids) for ids in token_ids)
        policy = RoutingPolicy("prefix", BalanceRule(balance_abs_threshold=total / self.size / 2))
        loads = [0] * self.size
        now = time.monotonic()
        chosen = []
        for prompt, ids in zip(prompts, token_ids):
            hashes = hash_request_tokens(ids, self.block_size, _cache_salt(prompt))
            decision = policy.choose([ReplicaLoad(r, loads[r]) for r in range(self.size)], hashes, self.index, now)
            loads[decision.replica] += len(ids)
            chosen.append(decision.replica)
        return chosen

    def _step_all(self, total: int, finished: dict[str, RequestOutput], use_tqdm: bool) -> None:
        """Step every replica with requests from a thread of its own until all are done,
        collecting the final outputs here; the first error of a replica is raised."""
        results: queue.Queue = queue.Queue()
        stop = threading.Event()
        threads = [threading.Thread(target=_step_until_done, args=(replica, stop, results), daemon=True,
                                    name=f"pagedllm-dp-{i}")
                   for i, replica in enumerate(self.replicas) if replica.has_unfinished_requests()]
        for thread in threads:
            thread.start()
        running = len(threads)
        try:
            with tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while running:
                    item = results.get()
                    if item is None:
                        running -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        finished[item.request_id] = item
                        bar.update(1)
        finally:
            stop.set()
            for thread in threads:
                thread.join()

    # ------------------------------------- the engine methods LLM reads

    def get_tokenizer(self):
        return self.replicas[0].get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].get_default_sampling_params()

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        for replica in self.replicas:
            replica.abort_request(request_id)

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

    def call(self, method: str, *args: Any) -> list[Any]:
        """An engine call on every replica: their answers, in replica order."""
        return [replica.call(method, *args) for replica in self.replicas]

    def metrics_registry(self) -> _ReplicaMetrics:
        return _ReplicaMetrics([replica.metrics_registry() for replica in self.replicas])

    def next_request_id(self) -> str:
        raise _no_single_engine("next_request_id")

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        raise _no_single_engine("add_request")

    def add_beam_request(self, *args: Any, **kwargs: Any) -> None:
        raise _no_single_engine("add_beam_request")

    def step(self) -> list[RequestOutput]:
        raise _no_single_engine("step")

    def shutdown(self) -> None:
        """Stop every replica's core. Safe to call twice."""
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


def _step_until_done(replica: EngineCoreProxy, stop: threading.Event, results: queue.Queue) -> None:
    """A stepping thread: every final output into ``results``, then None (or the error)."""
    try:
        while replica.has_unfinished_requests() and not stop.is_set():
            for output in replica.step():
                if output.finished:
                    results.put(output)
    except BaseException as exc:  # the caller's thread raises it
        results.put(exc)
        return
    results.put(None)


def _token_ids(prompt: Any) -> list[int]:
    """A prompt's token ids for routing (after ``tokenized``); [] for one the replica will refuse."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    if isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return list(ids)
    return []


def _cache_salt(prompt: Any) -> str | None:
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    return salt if isinstance(salt, str) and salt else None


def _no_single_engine(method: str) -> ValueError:
    return ValueError(f"{method} drives one engine and cannot be aggregated over replicas: with "
                      "data_parallel_size > 1 use generate, chat or beam_search (or LLM.llm_engine.replicas[i])")
