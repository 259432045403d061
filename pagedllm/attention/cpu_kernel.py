"""The C++ paged decode kernel for CPUs, compiled on first use.

``torch.utils.cpp_extension`` builds ``csrc/paged_decode.cpp`` with the
machine's compiler (cached under ``~/.cache/torch_extensions``, so only the
first engine start pays the ~1 minute build). If anything goes wrong (no
compiler, no ninja) the engine logs a warning and keeps the pure-PyTorch path;
``PAGEDLLM_CPU_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

from pagedllm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@functools.cache
def load_cpu_kernel():
    """The compiled module (with ``paged_decode_attention``), or None when unavailable."""
    if os.environ.get("PAGEDLLM_CPU_KERNEL", "1") == "0":
        return None
    # The venv's ninja is found even when the venv is not activated.
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="pagedllm_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # any build problem: fall back, never fail the engine
        logger.warning("C++ paged decode kernel unavailable (%s); using the PyTorch path", exc)
        return None
