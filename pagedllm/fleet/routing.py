"""Choosing a replica for a request: prefix-aware, round-robin or least-load.

Pure: the caller passes what it knows (each replica's load, the index of
cached blocks) and gets a ``RouteDecision``. The same policy serves the HTTP
router (``pagedllm router``, ``serve --data-parallel-size``) and the offline
``LLM(data_parallel_size=N)``, whose "load" is the tokens already given to each
replica.

The prefix rule is SGLang's cache-aware rule with load measured as requests in
flight: go to the replica holding the longest cached prefix of the prompt
(ties to the least loaded), unless that replica is overloaded compared with the
least-loaded one (more than ``balance_abs_threshold`` requests more *and* more
than ``balance_rel_threshold`` times as many) or its pool is nearly full, in
which case the least-loaded replica gets it; a prompt with no cached block
anywhere goes to the least-loaded replica.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.fleet.prefix_index import PrefixIndex

POLICIES = ("prefix", "round-robin", "least-load")


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica's load now."""

    replica: int
    in_flight: float  # requests (or, offline, tokens) sent and not finished
    kv_usage: float = 0.0  # fraction of its KV pool in use, 0..1 (from its /metrics)


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    hit_blocks: int  # leading blocks of the prompt the chosen replica holds (or was claimed to)
    reason: str  # "prefix", "balance" (best hit overloaded), "no-hit", "round-robin", "least-load"


@dataclass(frozen=True)
class BalanceRule:
    """When the best-hit replica is too busy to take a request (SGLang's names)."""

    balance_abs_threshold: float = 16
    balance_rel_threshold: float = 1.5
    kv_usage_threshold: float = 0.95

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold!r}")
        if self.balance_rel_threshold < 1:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold!r}")
        if not 0 < self.kv_usage_threshold <= 1:
            raise ValueError(f"kv_usage_threshold must be in (0, 1], got {self.kv_usage_threshold!r}")

    def overloaded(self, candidate: ReplicaLoad, lightest: ReplicaLoad) -> bool:
        if candidate.kv_usage >= self.kv_usage_threshold and lightest.kv_usage < self.kv_usage_threshold:
            return True
        return (candidate.in_flight - lightest.in_flight > self.balance_abs_threshold
                and candidate.in_flight > self.balance_rel_threshold * lightest.in_flight)


class RoutingPolicy:
    """One of ``POLICIES``; ``choose`` is called once per request, from one thread."""

    def __init__(self, policy: str = "prefix", balance: BalanceRule | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.balance = balance or BalanceRule()
        self._turn = itertools.count()

    def choose(self, loads: Sequence[ReplicaLoad], hashes: Sequence[int], index: PrefixIndex,
               now: float) -> RouteDecision:
        """The replica for a request whose prompt has block ``hashes``, among
        ``loads`` (the replicas up now; at least one). Records the routed blocks
        as a claim on the chosen replica when the policy is ``prefix``."""
        if not loads:
            raise ValueError("no replica is up")
        matched = index.leading_blocks(hashes, [load.replica for load in loads], now)
        if self.policy == "round-robin":
            chosen = loads[next(self._turn) % len(loads)]
            return RouteDecision(chosen.replica, matched[chosen.replica], "round-robin")
        lightest = self._least_loaded(loads)
        if self.policy == "least-load":
            return RouteDecision(lightest.replica, matched[lightest.replica], "least-load")
        best = max(loads, key=lambda load: (matched[load.replica], -load.in_flight, -load.kv_usage))
        if matched[best.replica] == 0:
            decision = RouteDecision(lightest.replica, 0, "no-hit")
        elif self.balance.overloaded(best, lightest):
            decision = RouteDecision(lightest.replica, matched[lightest.replica], "balance")
        else:
            decision = RouteDecision(best.replica, matched[best.replica], "prefix")
        index.claim(decision.replica, hashes, now)
        return decision

    def _least_loaded(self, loads: Sequence[ReplicaLoad]) -> ReplicaLoad:
        # Ties go round the replicas in turn, so an idle fleet spreads new prefixes evenly.
        start = next(self._turn) % len(loads)
        rotated = list(loads[start:]) + list(loads[:start])
        return min(rotated, key=lambda load: (load.in_flight, load.kv_usage))
