"""What a router computes: a request's block hashes as KV events carry them.

``hash_request_tokens`` must equal the engine's own hashes of a request (the
same chain, the same extra keys as ``Request``) and the documented algorithm,
reimplemented here from its description with hashlib alone, as a router in
another language would.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from pagedllm.core.block_hash import ROOT_HASH, extend_block_hashes, external_block_hash, hash_request_tokens
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def router_hashes(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[int]:
    """The algorithm of ``pagedllm.core.block_hash``'s docstring, from scratch."""
    parent = hashlib.sha256(b"pagedllm-block-hash-v1").digest()
    extra = json.dumps([] if cache_salt is None else [cache_salt], separators=(",", ":")).encode()
    wire = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        block = token_ids[start:start + block_size]
        message = parent + len(block).to_bytes(8, "little")
        message += b"".join(t.to_bytes(8, "little", signed=True) for t in block) + extra
        parent = hashlib.sha256(message).digest()
        wire.append(int.from_bytes(parent[-8:], "big"))
    return wire


TOKENS = [(i * 7919 + 13) % 151_936 for i in range(16 * 6 + 5)]  # 6 full blocks and a partial one


def test_external_hash_is_the_last_8_bytes_big_endian():
    digest = bytes(range(32))
    assert external_block_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big") == 0x18191A1B1C1D1E1F
    assert external_block_hash(b"\xff" * 32) == 2**64 - 1  # unsigned
    assert ROOT_HASH == hashlib.sha256(b"pagedllm-block-hash-v1").digest()


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("cache_salt", [None, "tenant-a", "ünïcode \"quoted\""])
def test_equals_the_engines_hashes_and_the_documented_algorithm(block_size, cache_salt):
    hashes = hash_request_tokens(TOKENS, block_size=block_size, cache_salt=cache_salt)
    extra = (cache_salt,) if cache_salt is not None else ()
    assert hashes == [external_block_hash(h) for h in extend_block_hashes([], TOKENS, block_size, extra)]
    assert hashes == router_hashes(TOKENS, block_size, cache_salt)
    assert len(hashes) == len(TOKENS) // block_size
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)


def test_uses_the_extra_keys_of_the_engines_request():
    for salt in (None, "tenant-b"):
        request = Request("r", TOKENS, SamplingParams(), eos_token_ids=[], max_tokens=8, cache_salt=salt)
        engine = extend_block_hashes(request.block_hashes, request.all_token_ids, 16, request.extra_keys)
        assert hash_request_tokens(TOKENS, cache_salt=salt) == [external_block_hash(h) for h in engine]


def test_the_partial_last_block_has_no_hash_and_a_prefix_shares_leading_hashes():
    full = hash_request_tokens(TOKENS)
    assert hash_request_tokens(TOKENS[:16 * 6]) == full  # the 5 trailing tokens change nothing
    assert hash_request_tokens(TOKENS[:16 * 3 + 15]) == full[:3]
    assert hash_request_tokens(TOKENS[:15]) == [] and hash_request_tokens([]) == []
    assert hash_request_tokens(tuple(TOKENS)) == full  # any sequence of ints
    changed = list(TOKENS)
    changed[16 * 2] += 1  # a token of block 2: it and every later block differ, the first two do not
    other = hash_request_tokens(changed)
    assert other[:2] == full[:2] and all(a != b for a, b in zip(other[2:], full[2:]))


def test_a_salt_changes_every_hash():
    plain = hash_request_tokens(TOKENS)
    for salt in ("a", "b"):
        salted = hash_request_tokens(TOKENS, cache_salt=salt)
        assert all(p != s for p, s in zip(plain, salted)) and not set(plain) & set(salted)
    assert not set(hash_request_tokens(TOKENS, cache_salt="a")) & set(hash_request_tokens(TOKENS, cache_salt="b"))
    assert hash_request_tokens(TOKENS, cache_salt="") != plain  # an empty salt is a salt ([""] vs [])


def test_a_non_ascii_salt_is_hashed_as_its_escaped_json_text():
    """What a router in another language must write: ``["caf\\u00e9"]``, ASCII only."""
    tokens = list(range(16))
    block = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    digest = hashlib.sha256(ROOT_HASH + (16).to_bytes(8, "little") + block + b'["caf\\u00e9"]').digest()
    assert hash_request_tokens(tokens, cache_salt="caf\u00e9") == [int.from_bytes(digest[-8:], "big")]


def test_the_documented_test_vectors():
    assert hash_request_tokens(list(range(16)) * 2) == [3033277805137351077, 14884897223833445823]
    assert hash_request_tokens(list(range(16)), cache_salt="tenant-a") == [6873969315485558001]


@pytest.mark.parametrize("block_size", [0, -16, 12, 512, 16.0, True, "16"])
def test_a_bad_block_size_is_refused_by_name(block_size):
    with pytest.raises(ValueError, match="block_size"):
        hash_request_tokens(TOKENS, block_size=block_size)
