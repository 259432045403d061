"""Small pure-Python helpers shared by several layers (no torch import).

Each fact here had copies in two or three modules; keeping one copy means a
fix lands everywhere at once.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
MAX_BLOCK_SIZE = 256


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers: ``ceil(a / b)`` without floats."""
    return -(-a // b)


def check_block_size(block_size: object) -> None:
    """Raise ``ValueError`` unless ``block_size`` is a power of two in
    ``[1, MAX_BLOCK_SIZE]`` (the kernels index slots with shifts)."""
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or not 1 <= block_size <= MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a power of two between 1 and {MAX_BLOCK_SIZE}, got {block_size!r}")


def splitmix64(x: int) -> int:
    """One round of splitmix64: a 64-bit bijection whose outputs look independent
    even for neighbouring inputs (seeds of forks, positions of a sequence)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, value: int) -> int:
    """A 63-bit seed that depends only on ``(seed, value)``: two rounds of
    splitmix64, so neighbouring seeds and values give unrelated results (torch's
    CPU generator only uses the low 32 bits of its seed, so those must be well
    mixed too). The sampler derives a row's generator seed from (request seed,
    output position); forks derive a sample's seed from (request seed, index)."""
    return splitmix64(splitmix64(seed & MASK64) ^ (value & MASK64)) >> 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick; another process may take it before it is bound)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
