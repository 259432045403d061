"""The fleet's routing, pure: the prefix index and the policy's decisions against
hand-computed expectations."""

from __future__ import annotations

import pytest

from pagedllm.core.block_hash import hash_request_tokens
from pagedllm.fleet.prefix_index import PrefixIndex
from pagedllm.fleet.routing import BalanceRule, ReplicaLoad, RoutingPolicy

SYSTEM_A = list(range(100, 164))  # 4 blocks of 16
SYSTEM_B = list(range(500, 564))


def loads(*in_flight: float, usage: tuple[float, ...] = ()) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, n, usage[i] if usage else 0.0) for i, n in enumerate(in_flight)]


def test_index_counts_leading_blocks_held_per_replica():
    index = PrefixIndex(claim_ttl_s=0)
    hashes = hash_request_tokens(SYSTEM_A + [1, 2, 3])  # 4 full blocks, the tail has no hash
    assert len(hashes) == 4
    index.stored(0, hashes[:3])
    index.stored(1, hashes[:1] + hashes[2:])  # block 1 missing: only block 0 leads
    assert index.leading_blocks(hashes, [0, 1, 2], now=0) == {0: 3, 1: 1, 2: 0}
    index.removed(0, hashes[1:2])
    assert index.leading_blocks(hashes, [0, 1], now=0) == {0: 1, 1: 1}
    assert index.held_blocks(1) == 3
    index.cleared(1)
    assert index.leading_blocks(hashes, [0, 1], now=0) == {0: 1, 1: 0}
    assert index.held_blocks(1) == 0 and index.size() == (2, 0)


def test_a_block_in_a_replicas_host_or_disk_tier_is_still_a_hit_there():
    index = PrefixIndex(claim_ttl_s=0)
    hashes = hash_request_tokens(SYSTEM_A)
    index.stored(0, hashes)
    index.stored(0, hashes[:2], medium="CPU")  # evicted from the pool into host memory
    index.removed(0, hashes)
    assert index.leading_blocks(hashes, [0, 1], now=0) == {0: 2, 1: 0}
    assert (index.held_blocks(0), index.held_blocks(0, "CPU")) == (0, 2)
    index.removed(0, hashes[1:2], medium="CPU")
    index.stored(1, hashes, medium="DISK")
    assert index.leading_blocks(hashes, [0, 1], now=0) == {0: 1, 1: 4}
    index.cleared(0)
    assert index.leading_blocks(hashes, [0], now=0) == {0: 0} and index.held_blocks(0, "CPU") == 0


def test_claims_count_until_they_expire_and_clearing_drops_them():
    index = PrefixIndex(claim_ttl_s=10)
    hashes = hash_request_tokens(SYSTEM_A)
    index.claim(1, hashes, now=0)
    index.claim(1, hashes[:2], now=5)
    assert index.leading_blocks(hashes, [0, 1], now=9) == {0: 0, 1: 4}
    assert index.leading_blocks(hashes, [0, 1], now=10) == {0: 0, 1: 2}  # the first claim expired
    assert index.leading_blocks(hashes, [1], now=15) == {1: 0}
    index.claim(0, hashes, now=20)
    index.cleared(0)
    assert index.leading_blocks(hashes, [0], now=21) == {0: 0} and index.size() == (0, 0)


def test_prefix_policy_follows_the_longest_hit_and_claims_it():
    index = PrefixIndex()
    policy = RoutingPolicy("prefix")
    a = hash_request_tokens(SYSTEM_A + list(range(16)))
    b = hash_request_tokens(SYSTEM_B + list(range(16)))
    index.stored(1, a[:4])
    decision = policy.choose(loads(0, 3), a, index, now=0)
    assert (decision.replica, decision.hit_blocks, decision.reason) == (1, 4, "prefix")
    # A new prefix goes to the least-loaded replica, and its claim pulls the next request with it.
    first = policy.choose(loads(2, 0), b, index, now=0)
    assert (first.replica, first.reason) == (1, "no-hit")
    second = policy.choose(loads(0, 1), b, index, now=0)
    assert (second.replica, second.hit_blocks, second.reason) == (1, 5, "prefix")


def test_an_overloaded_best_hit_gives_way_to_the_least_loaded():
    index = PrefixIndex()
    policy = RoutingPolicy("prefix", BalanceRule(balance_abs_threshold=4, balance_rel_threshold=2))
    hashes = hash_request_tokens(SYSTEM_A)
    index.stored(0, hashes)
    assert policy.choose(loads(6, 2), hashes, index, now=0).reason == "prefix"  # 4 more: not over 4
    assert policy.choose(loads(13, 7), hashes, index, now=0).reason == "prefix"  # 6 more, but not over 2x
    decision = policy.choose(loads(7, 2), hashes, index, now=0)  # 5 more and over 2x
    assert (decision.replica, decision.reason) == (1, "balance")
    fresh = PrefixIndex()  # (the balance decision claimed the prefix on replica 1)
    fresh.stored(0, hashes)
    full = policy.choose(loads(0, 0, usage=(0.97, 0.2)), hashes, fresh, now=0)
    assert (full.replica, full.reason) == (1, "balance")


def test_tenant_salts_keep_prefixes_apart():
    index = PrefixIndex(claim_ttl_s=0)
    policy = RoutingPolicy("prefix")
    index.stored(0, hash_request_tokens(SYSTEM_A, cache_salt="tenant:alice"))
    bob = policy.choose(loads(5, 0), hash_request_tokens(SYSTEM_A, cache_salt="tenant:bob"), index, now=0)
    assert (bob.replica, bob.hit_blocks, bob.reason) == (1, 0, "no-hit")
    alice = policy.choose(loads(5, 0), hash_request_tokens(SYSTEM_A, cache_salt="tenant:alice"), index, now=0)
    assert (alice.replica, alice.hit_blocks) == (0, 4)


def test_round_robin_and_least_load():
    index = PrefixIndex()
    hashes = hash_request_tokens(SYSTEM_A)
    index.stored(0, hashes)
    rr = RoutingPolicy("round-robin")
    assert [rr.choose(loads(0, 0, 0), hashes, index, now=0).replica for _ in range(4)] == [0, 1, 2, 0]
    least = RoutingPolicy("least-load")
    assert least.choose(loads(3, 1, 2), hashes, index, now=0).replica == 1
    assert index.size()[1] == 0  # only the prefix policy claims


def test_bad_policy_settings_are_value_errors():
    with pytest.raises(ValueError, match="router policy"):
        RoutingPolicy("random")
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        BalanceRule(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="no replica is up"):
        RoutingPolicy().choose([], [], PrefixIndex(), now=0)
