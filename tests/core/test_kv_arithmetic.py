"""`pagedllm explain` reproduces the reference documents' arithmetic."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_arithmetic import KVShape, explain_groups, human
from pagedllm.entrypoints.cli import main

SEVENTY_B = ["explain", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--dtype", "float16"]


def run(capsys, argv: list[str]) -> str:
    main(argv)
    return capsys.readouterr().out


def test_the_70b_class_numbers(capsys):
    out = run(capsys, SEVENTY_B)
    expected = [
        "2 (K, V) x 80 layers x 8 KV heads x 128 dims x 2 bytes (float16) = 327,680 bytes = 320 KiB",
        "bytes per 16-token block: 16 x 320 KiB = 5,242,880 bytes = 5 MiB",
        "contiguous reservation of 4,096 tokens (max_model_len): 4,096 x 320 KiB = 1.25 GiB",
        "ceil(4,096 / 16) = 256 entries x 4 bytes = 1 KiB, guarding 1.25 GiB",
        "a 300-token chat: 300 x 320 KiB = 93.75 MiB; contiguous waste (1.25 GiB - 93.75 MiB) / 1.25 GiB = 92.7%",
        "paged: 19 blocks (95 MiB, a 19-entry block table), waste 4 tokens = 1.3%",
        "| 8 | 3.5 | 1.2% | 38 |", "| 16 | 7.5 | 2.5% | 19 |", "| 128 | 63.5 | 21.2% | 3 |",
        "unshared 4 x 2,000 x 320 KiB = 2.44 GiB; shared once (125 blocks, ref count 4) = 625 MiB: 4.0x less, "
        "1.83 GiB saved",
        "unshared 500 x 3,000 x 320 KiB = 457.76 GiB; prefix-cached 188 blocks x 5 MiB = 940 MiB: 499x less",
    ]
    for line in expected:
        assert line in out, line


def test_the_a100_8b_pool(capsys):
    out = run(capsys, ["explain", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "float16",
                       "--kv-memory-gib", "54"])
    assert "= 131,072 bytes = 128 KiB" in out and "= 2,097,152 bytes = 2 MiB" in out
    assert "pool of 54 GiB: 27,648 blocks = 442,368 tokens" in out


def test_the_loaded_model(capsys):
    out = run(capsys, ["explain"])
    assert "2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (float32) = 46,080 bytes = 45 KiB" in out
    assert "contiguous reservation of 8,192 tokens" in out  # SmolLM2's context window


def test_bad_shapes_are_clear_errors(capsys):
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        KVShape(0, 8, 128, "float16")
    with pytest.raises(SystemExit):
        main(["explain", "--layers", "80"])
    assert "give all of --layers, --kv-heads and --head-dim" in capsys.readouterr().err


def test_human_units():
    assert [human(n) for n in (512, 1536, 5 * 2**20, int(1.25 * 2**30))] == ["512 bytes", "1.5 KiB", "5 MiB", "1.25 GiB"]


def test_a_hybrid_model_explains_its_groups_and_what_the_window_saves():
    gemma3 = [512 if (layer + 1) % 6 else None for layer in range(18)]  # Gemma 3 270M's layout
    lines = "\n".join(explain_groups(KVShape(18, 1, 256, "float32"), gemma3, 32768))
    # 2 x 1 head x 256 dims x 4 bytes = 2 KiB per layer and token; a block of 16 tokens x 3 layers.
    assert ("hybrid KV cache manager: 6 KV cache groups of 6144 B/token: group 0 full attention (layers 5,11,17); "
            "groups 1-5 sliding window 512, for their last 512 tokens (layers 0-4,6-10,12-16)") in lines
    assert "holds 3 layers: 16 x 3 x 2 KiB = 96 KiB" in lines
    # 32,768 tokens: 2,048 full blocks + 5 groups x the 32 blocks of a 512 window, against 2,048 blocks x 18 layers.
    assert f"a 32,768-token sequence holds {human((2048 + 5 * 32) * 96 * 2**10)} (hybrid) vs 1.12 GiB" in lines
    assert explain_groups(KVShape(4, 1, 8, "float32"), [None] * 4, 4096) == []
