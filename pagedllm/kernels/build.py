"""``python -m pagedllm.kernels.build``: compile the C++ CPU kernels now.

``make install`` runs it, so that no engine start pays for the build. A failed
build is reported but exits 0: the engine still runs, on its PyTorch paths.
"""

from __future__ import annotations

from pagedllm.kernels.cpu import load_cpu_kernels


def main() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        print("C++ CPU kernels not built (see the warning above, or PAGEDLLM_CPU_KERNEL=0); "
              "pagedllm will use its PyTorch paths")
    else:
        print(f"C++ CPU kernels ready: {kernels.__file__}")


if __name__ == "__main__":
    main()
