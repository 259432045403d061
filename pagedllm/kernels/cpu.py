"""The C++ CPU kernels, compiled for this machine.

``torch.utils.cpp_extension`` builds ``csrc/*.cpp`` with the machine's compiler
for the machine's own instruction set (cached under
``~/.cache/torch_extensions/pagedllm_cpu_kernels-<hash>``, one folder per
environment, checkout and source text). ``make install`` builds them
(``python -m pagedllm.kernels.build``); otherwise the first engine start does,
announcing it, since it takes a minute or two. If anything goes wrong (no
compiler, no ninja) the engine logs a warning and every caller keeps its
pure-PyTorch path; ``PAGEDLLM_CPU_KERNEL=0`` turns the kernels off.

The module provides: ``paged_decode_attention`` (paged_decode.cpp), ``prefill_attention``
(prefill_attention.cpp), ``varlen_attention`` and ``varlen_attention_available`` (varlen_attention.cpp),
``rms_norm``, ``rotary_embedding``, ``silu_and_mul`` (layer_ops.cpp), ``write_kv_cache`` (kv_write.cpp),
``linear_small_batch`` (small_batch_linear.cpp), ``packed_linear`` and
``packed_linear_available`` (packed_linear.cpp), ``quant_linear`` and
``quant_dequantize`` (quant_linear.cpp), ``moe_grouped_linear`` (moe_grouped.cpp), ``lora_bgmv`` (lora_ops.cpp) and
``argmax_logsumexp`` (sampling_ops.cpp), ``DecodeStack`` and ``fused_linear`` (decode_stack.cpp: a Llama
stack's decode step in one call, ``model/fused_decode.py``).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedllm.logger import init_logger

logger = init_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_decode.cpp", "layer_ops.cpp", "kv_write.cpp", "small_batch_linear.cpp",
            "sampling_ops.cpp", "quant_linear.cpp", "prefill_attention.cpp", "packed_linear.cpp",
            "lora_ops.cpp", "moe_grouped.cpp", "varlen_attention.cpp", "decode_stack.cpp"]


_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
_MODULE_NAME = "pagedllm_cpu_kernels"


def _build_directory() -> Path:
    """One build folder per Python environment, torch version, checkout and
    source text, so two virtualenvs (or two checkouts sharing one) never
    rebuild over each other's objects: ninja rebuilds whenever the source paths
    in its commands change."""
    digest = hashlib.sha256()
    for part in (sys.prefix, torch.__version__, " ".join(_CFLAGS), str(_CSRC)):
        digest.update(part.encode())
    for path in [_CSRC / name for name in _SOURCES] + sorted(_CSRC.glob("*.h")):
        digest.update(path.read_bytes())
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    directory = cache / f"{_MODULE_NAME}-{digest.hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Hold an OS lock on the build folder while torch builds or loads it.

    torch's own ``lock`` file outlives a build killed by a signal, and every
    later process then waits on it forever. The OS drops this lock when its
    holder dies, however it dies, so a torch lock found under it is stale.
    """
    # POSIX only; elsewhere the ImportError is a build failure like any other.
    import fcntl

    with open(directory / "build.flock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building the C++ CPU kernels in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


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

        directory = _build_directory()
        with _exclusive_build(directory):
            if not (directory / f"{_MODULE_NAME}.so").exists():
                logger.info("compiling the C++ CPU kernels (pagedllm/kernels/csrc) for this machine: once per "
                            "install, a minute or two; later starts load them from %s", directory)
            return load(
                name=_MODULE_NAME,
                sources=[str(_CSRC / name) for name in _SOURCES],
                # Fast math lets reductions vectorize; inf/NaN semantics stay, since
                # masked logits and empty softmax sums rely on -inf.
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # any build problem: fall back, never fail the engine
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch paths", exc)
        return None


def cpu_kernels_for(tensor: torch.Tensor):
    """The compiled module when ``tensor`` lives on the CPU and the build succeeded, else None."""
    return load_cpu_kernels() if tensor.is_cpu else None

