r"""Chained block hashes: the identity of a full block's contents for prefix caching.

``hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys)``.
Because each hash covers its parent's, two requests share block ``i`` only if
every token from position 0 up to the end of that block is equal, and their
extra keys (the tenant's ``cache_salt``, the LoRA adapter's name, the images) match. sha256 is stable across processes (unlike Python's salted
``hash()``) and collision resistant: an accidental collision, which would let
one request read another's K/V, has probability ~2^-128 even after 2^64 blocks.

The algorithm, exactly (a router in any language can recompute it):

1. Split the token ids into blocks of ``block_size``; a partial last block has no hash.
2. ``ROOT_HASH = sha256(b"pagedllm-block-hash-v1")`` is block 0's parent.
3. ``hash_i = sha256(parent || len(block) as 8-byte little-endian || each token id
   as 8-byte little-endian signed || JSON of the extra keys)``, where the extra keys
   are ``[]``, ``[cache_salt]`` (a JSON string), then for a request under a LoRA
   adapter ``["lora", name]`` appended, then, in a block that covers any of an image's
   placeholder positions, ``["mm", content hash]`` for each such image in prompt order
   (``multimodal/inputs.py``: the same text around another image never hits, and the
   blocks after it differ through the chain); written with separators ``,`` and
   ``:`` and no spaces, e.g. ``[]``, ``["tenant-a"]`` or ``["tenant-a",["lora","sql"]]``,
   as Python's ``json.dumps``
   writes it (non-ASCII characters as ``\uXXXX`` escapes: ``["caf\u00e9"]``);
   ``parent`` is ``hash_{i-1}``.
4. On the wire (KV events, ``hash_request_tokens``) a hash is the unsigned 64-bit
   integer of its last 8 bytes, big-endian, as vLLM sends its block hashes
   (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

Test vectors for a reimplementation (``hash_request_tokens``, block size 16):
token ids ``0..15`` twice -> ``[3033277805137351077, 14884897223833445823]``;
``0..15`` with ``cache_salt="tenant-a"`` -> ``[6873969315485558001]``;
``0..15`` with an image ``"abc"`` over positions 4..7 (``mm_spans=[(4, 4, "abc")]``) -> ``[6685555401624510419]``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence

from pagedllm.utils import check_block_size

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


# An image's placeholder run in the prompt: (offset, length, content hash).
MultiModalSpan = tuple[int, int, str]


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple = (),
    mm_spans: Sequence[MultiModalSpan] = (),
) -> list[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet
    (``hashes`` holds those of the first blocks already); returns ``hashes``.
    ``mm_spans``: the images whose content hashes key the blocks they cover."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[index - 1] if index else ROOT_HASH
        start, end = index * block_size, (index + 1) * block_size
        keys = extra_keys + block_image_keys(index, block_size, mm_spans)
        hashes.append(hash_block(parent, token_ids[start:end], keys))
    return hashes


def block_image_keys(index: int, block_size: int, mm_spans: Sequence[MultiModalSpan]) -> tuple:
    """The ``["mm", content hash]`` keys of block ``index``: one per image whose placeholder
    run it covers any position of, in prompt order (its hash's extra keys, its events' too)."""
    start, end = index * block_size, (index + 1) * block_size
    return tuple(["mm", identifier] for offset, length, identifier in mm_spans
                 if offset < end and start < offset + length)


def external_block_hash(block_hash: BlockHash) -> int:
    """A block hash as KV events carry it: the last 8 bytes, big-endian (vLLM's int form)."""
    return int.from_bytes(block_hash[-8:], "big")


def hash_request_tokens(token_ids: Sequence[int], block_size: int = 16, cache_salt: str | None = None,
                        lora_name: str | None = None, lora_fingerprint: str = "",
                        mm_spans: Sequence[MultiModalSpan] = ()) -> list[int]:
    """The hashes of a request's full blocks exactly as ``BlockStored`` events
    carry them: what a router compares with a replica's events to know how
    many leading blocks of a prompt it already holds. A LoRA request's blocks need its
    adapter's name and the fingerprint the replica's engine keys it by; a prompt with
    images needs their placeholder spans and content hashes (``mm_spans``)."""
    check_block_size(block_size)
    extra_keys = request_extra_keys(cache_salt, lora_name, lora_fingerprint)
    hashes = extend_block_hashes([], list(token_ids), block_size, extra_keys, mm_spans)
    return [external_block_hash(h) for h in hashes]


def request_extra_keys(cache_salt: str | None, lora_name: str | None, lora_fingerprint: str = "") -> tuple:
    """What besides its tokens a request's blocks are keyed by: the tenant's salt, then
    the LoRA adapter as ``["lora", name]`` or, when its files' digest is known,
    ``["lora", name, fingerprint]`` (a JSON list, so no salt string can equal it).
    K/V computed under one adapter is then never served to another or to the base."""
    keys: tuple = (cache_salt,) if cache_salt is not None else ()
    if lora_name is None:
        return keys
    return keys + (["lora", lora_name, lora_fingerprint] if lora_fingerprint else ["lora", lora_name],)
