"""Chained block hashes: the identity of a full block's contents for prefix caching.

``hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys)``.
Because each hash covers its parent's, two requests share block ``i`` only if
every token from position 0 up to the end of that block is equal, and their
extra keys (the tenant's ``cache_salt``, room for a LoRA id or multimodal
hashes) match. sha256 is stable across processes (unlike Python's salted
``hash()``) and collision resistant: an accidental collision, which would let
one request read another's K/V, has probability ~2^-128 even after 2^64 blocks.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes

# The parent of block 0: a fixed, versioned value so that a change of encoding
# can never make old and new hashes collide.
ROOT_HASH: BlockHash = hashlib.sha256(b"pagedllm-block-hash-v1").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash one full block. Encoding: parent digest, the token count and ids as
    little-endian int64, then the extra keys as canonical JSON."""
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    digest = hashlib.sha256(parent)
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(tokens.tobytes())
    digest.update(json.dumps(list(extra_keys), separators=(",", ":")).encode())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> list[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet
    (``hashes`` holds those of the first blocks already); returns ``hashes``."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[index - 1] if index else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], extra_keys))
    return hashes
