"""`pagedllm bench moe`'s pieces on a tiny shape: the random GGUF it writes reads back in gguf-py
(types, shapes, sane Q4_K values) and decodes in pagedllm through both expert paths (the
``PAGEDLLM_MOE_GROUPED=0`` switch really takes the per-expert loop, with the same greedy
tokens); the roofline arithmetic, llama-batched-bench's table parsing and the result table."""

from __future__ import annotations

import argparse

import gguf
import numpy as np
import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedllm import LLM, SamplingParams
from pagedllm.bench import commands, moe
from pagedllm.bench.cli import add_bench_parser
from pagedllm.bench.moe_gguf import BLOCKS, Q4_K, Q8_0, MoeShape, TokenizerKeys, bytes_per_token, write_moe_gguf
from pagedllm.bench.moe_llama import batched_bench_command, parse_decode_rates
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model.moe import packed_experts
from tests.conftest import assert_pool_free

TINY = MoeShape(hidden=256, layers=2, experts=4, active=2, expert_width=256, heads=2, kv_heads=1, head_dim=128,
                dense_width=512, vocab=320)


def _byte_tokenizer(vocab: int) -> TokenizerKeys:
    """A byte-level gpt2 vocabulary padded to ``vocab`` tokens (the bench copies SmolLM2's 49k)."""
    tokens = [*bytes_to_unicode().values(), "hi"]
    tokens += [f"<t{i}>" for i in range(vocab - len(tokens))]
    strings = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    number = [gguf.GGUFValueType.UINT32]
    return TokenizerKeys((("tokenizer.ggml.model", "gpt2", [gguf.GGUFValueType.STRING]),
                          ("tokenizer.ggml.tokens", tokens, strings), ("tokenizer.ggml.merges", ["h i"], strings),
                          ("tokenizer.ggml.bos_token_id", 0, number), ("tokenizer.ggml.eos_token_id", 1, number)),
                         vocab)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("moe") / "tiny.gguf", TINY, _byte_tokenizer(TINY.vocab))


def test_gguf_reads_back_in_gguf_py(tiny_gguf):
    tensors = {t.name: t for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert gate.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert [int(size) for size in gate.shape] == [256, 256, 4]  # GGUF order: in, out, experts
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    values = gguf.quants.dequantize(gate.data, gate.tensor_type)
    assert np.isfinite(values).all() and abs(values.mean()) < 0.01 and 0.01 < values.std() < 0.1
    assert tiny_gguf.stat().st_size >= sum(t.n_bytes for t in tensors.values())


def test_bytes_per_token_counts_active_experts_and_dense_tensors():
    q8, q4 = BLOCKS[Q8_0][1] / 32, BLOCKS[Q4_K][1] / 256  # bytes per weight
    experts = 2 * 3 * 256 * 256 * q4  # per layer: 2 active experts' gate, up and down
    attention = (256 * 256 * 2 + 128 * 256 * 2) * q8
    small = (4 * 256 + 256 * 2 + 128 * 2) * 4  # router, two norms, q/k norms (F32)
    head = 320 * 256 * q8 + 256 * 4 + 256 * q8  # LM head, final norm, one embedding row
    assert bytes_per_token(TINY) == 2 * (experts + attention + small) + head
    assert moe.roofline_tokens_per_s(TINY, 10.0) == pytest.approx(10e9 / bytes_per_token(TINY))


@pytest.mark.slow
def test_tiny_model_decodes_through_both_expert_paths(tiny_gguf, monkeypatch):
    if load_cpu_kernels() is None:
        pytest.skip("the grouped kernel is C++: the kernels did not build here")
    calls = []
    loop = packed_experts.loop_forward
    monkeypatch.setattr(packed_experts, "loop_forward", lambda *a: calls.append(1) or loop(*a))
    llm = LLM(str(tiny_gguf), max_model_len=64, num_kv_blocks=16, enable_prefix_caching=False)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for grouped in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_MOE_GROUPED", grouped)
        assert moe.timed_decode(llm, prompts, 4) > 0
        assert bool(calls) == (grouped == "0")
        outputs[grouped] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
        assert_pool_free(llm)
    assert outputs["1"] == outputs["0"]


LLAMA_OUTPUT = """main: n_kv_max = 3088, n_batch = 2048
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     64 |    8 |    768 |    1.234 |   207.46 |    9.876 |    51.84 |   11.110 |    69.13 |
"""


def test_llama_batched_bench_parsing():
    assert parse_decode_rates(LLAMA_OUTPUT) == {8: 51.84}
    command = batched_bench_command("llama-batched-bench", "m.gguf", 8, 32, 64, 2)
    assert command[command.index("-npl") + 1] == "8" and int(command[command.index("-c") + 1]) >= 8 * 96


def test_table_ratios_and_roofline_share():
    rows = [moe.MoeRow(1, {"grouped": 4.0, "loop": 2.0, "llama.cpp": 5.0}, [1.5, 1.0, 2.0]),
            moe.MoeRow(32, {"grouped": 30.0, "loop": 10.0}, [3.0, 3.0])]
    result = moe.MoeResult(TINY, rows, bandwidth_gbps=bytes_per_token(TINY) * 8 / 1e9, threads=2)
    assert result.roofline_tokens_per_s == pytest.approx(8.0)
    lines = moe.format_table(result).splitlines()
    assert lines[2] == "| 1 | 4.00 | 2.00 | 5.00 | 0.80x | 2.00x | 50% of 8.0 | 1.5 / 1.0 / 2.0 |"
    assert lines[3] == "| 32 | 30.00 | 10.00 | - | - | 3.00x | - | 3.0 / 3.0 |"


def test_command_line_parses():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "moe", "--layers", "2", "--batch", "1", "4", "--record", "B.md"])
    assert args.func is commands.cmd_bench_moe
    assert (args.layers, args.batch, args.output_len, args.record) == (2, [1, 4], 64, "B.md")
