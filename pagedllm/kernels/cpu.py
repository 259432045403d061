"""The C++ CPU kernels, compiled on first use.

``torch.utils.cpp_extension`` builds ``csrc/*.cpp`` with the machine's compiler
for the machine's own instruction set (cached under
``~/.cache/torch_extensions/pagedllm_cpu_kernels-<hash>``, one folder per
environment and source text, so only the first engine start pays the ~1 minute
build). If anything goes wrong (no compiler, no ninja) the engine logs a
warning and every caller keeps its pure-PyTorch path; ``PAGEDLLM_CPU_KERNEL=0``
turns the kernels off.

The module provides: ``paged_decode_attention`` (paged_decode.cpp),
``rms_norm``, ``rotary_embedding``, ``silu_and_mul`` (layer_ops.cpp), ``write_kv_cache`` (kv_write.cpp),
``linear_small_batch`` (small_batch_linear.cpp) and ``argmax_logsumexp``
(sampling_ops.cpp).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from pagedllm.logger import init_logger

logger = init_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_decode.cpp", "layer_ops.cpp", "kv_write.cpp", "small_batch_linear.cpp",
            "sampling_ops.cpp"]


_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
# A build takes a minute or two; a lock older than this was left by a build
# that was killed (torch would wait on it forever).
_STALE_LOCK_S = 15 * 60


def _build_directory() -> Path:
    """One build folder per Python environment, torch version and source text,
    so two virtualenvs (or two checkouts) never rebuild over each other's
    objects, and a stale lock from an interrupted build is cleared."""
    digest = hashlib.sha256()
    for part in (sys.prefix, torch.__version__, " ".join(_CFLAGS)):
        digest.update(part.encode())
    for name in _SOURCES + ["ops.h", "dtype.h", "fast_exp.h", "lanes.h", "vec16.h"]:
        digest.update((_CSRC / name).read_bytes())
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    directory = cache / f"pagedllm_cpu_kernels-{digest.hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        logger.warning("removing a stale kernel build lock left by an interrupted build: %s", lock)
        lock.unlink(missing_ok=True)
    return directory


@functools.cache
def load_cpu_kernels():
    """The compiled module, or None when unavailable (callers then use PyTorch)."""
    if os.environ.get("PAGEDLLM_CPU_KERNEL", "1") == "0":
        return None
    # The venv's ninja is found even when the venv is not activated.
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="pagedllm_cpu_kernels",
            sources=[str(_CSRC / name) for name in _SOURCES],
            # Fast math lets reductions vectorize; inf/NaN semantics stay, since
            # masked logits and empty softmax sums rely on -inf.
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_directory()),
            verbose=False,
        )
    except Exception as exc:  # any build problem: fall back, never fail the engine
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch paths", exc)
        return None


def cpu_kernels_for(tensor: torch.Tensor):
    """The compiled module when ``tensor`` lives on the CPU and the build succeeded, else None."""
    return load_cpu_kernels() if tensor.is_cpu else None
