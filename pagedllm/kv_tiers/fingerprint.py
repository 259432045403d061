"""What a tier block was computed for: its fingerprint.

A block's K/V depend on the weights, the dtype, the KV storage type, the
block size and the pool's layout. The tiers key blocks by their chained hash
(which covers tokens and salt) *and* this fingerprint, so a block is never
served to a model or layout it was not computed for: a different checkpoint,
a fine-tune at the same path, another dtype or ``gguf_weights`` mode, or
another KV cache group layout each get a folder of their own, and every
file's header repeats the fingerprint.

The weights are identified by content, cheaply: each checkpoint file's name,
size and the digests of its first, middle and last MiB (two engines loading
the same files from different paths agree; a re-exported file does not).
"""

from __future__ import annotations

import hashlib
import json
import os

from pagedllm.core.kv_groups import KVGroupLayout

_SAMPLE = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")
FORMAT_VERSION = 1


def weights_identity(model_path: str) -> list[list]:
    """[name, size, digest of sampled bytes] for each file that defines the model."""
    if os.path.isdir(model_path):
        paths = sorted(os.path.join(model_path, name) for name in os.listdir(model_path)
                       if name.endswith(_WEIGHT_SUFFIXES))
    else:
        paths = [model_path]
    identity = []
    for path in paths:
        size = os.path.getsize(path)
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                file.seek(offset)
                digest.update(file.read(_SAMPLE))
        identity.append([os.path.basename(path), size, digest.hexdigest()])
    return identity


def tier_fingerprint(model_path: str, dtype: str, kv_cache_dtype: str, block_size: int, layout: str,
                     gguf_weights: str, kv_groups: KVGroupLayout | None = None) -> str:
    """The hex sha256 that names a pool's blocks in the tiers. A hybrid layout's
    groups (``core.kv_groups``) are part of it: its block holds one group's layers
    in its slots, which a one-group block of the same size would not mean. One
    group adds nothing, so the fingerprints (and folders) of one-group pools are
    the ones they had before groups existed."""
    description: dict[str, object] = {
        "format": FORMAT_VERSION,
        "weights": weights_identity(model_path),
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "block_size": block_size,
        "layout": layout,
        "gguf_weights": gguf_weights,
    }
    if kv_groups is not None and kv_groups.is_hybrid:
        # A chunk size only where there is one, so the fingerprints of windowed layouts stay as they were.
        description["kv_groups"] = [[group.kind, list(group.layers), group.window]
                                    + ([group.chunk] if group.chunk is not None else []) for group in kv_groups.groups]
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
