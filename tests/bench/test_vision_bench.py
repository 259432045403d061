"""`pagedllm bench vision`'s pieces on the tiny shape: the workload's repeats hit the encoder
cache (no encoder run, in the workload and alone), pagedllm's greedy tokens equal Hugging Face
``generate``'s on the same batched inputs, and the table has its columns."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedllm import LLM
from pagedllm.bench import commands, vision
from pagedllm.bench.cli import add_bench_parser
from pagedllm.bench.vision_model import cached_vision_model
from tests.conftest import assert_pool_free

pytestmark = pytest.mark.slow  # the tiny checkpoint (SmolLM2's tokenizer from its GGUF), an engine and HF


def test_repeats_hit_the_encoder_cache_and_greedy_equals_hugging_face(tmp_path, smollm_tokenizer):
    folder = cached_vision_model(tmp_path, "tiny", smollm_tokenizer)
    assert cached_vision_model(tmp_path, "tiny") == folder  # the second call reuses the folder
    requests = vision.workload(6, seed=0)
    assert [r.repeat for r in requests] == [False] * 3 + [True] * 3
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, block_size=16)
    run = vision.run_pagedllm(llm, "pagedllm", requests, output_len=4, ttft_pairs=1)
    assert_pool_free(llm)
    llm.shutdown()
    assert run.encoder_runs == 3 and run.encoder_seconds > 0  # each distinct image encoded once
    assert run.encoder_new[0] > 0 and run.encoder_repeat == [0.0]
    hf = vision.run_hugging_face(folder, requests, output_len=4, batch_size=4, dtype=torch.float32)
    assert run.tokens == hf.tokens and all(run.tokens)
    header, rule, *rows = vision.format_table([hf, run], requests).splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "system", "seconds", "requests/s", "output tok/s", "vs HF", "encoder s (runs)",
        "encoder ms alone, new / repeat", "TTFT p50 ms, new / repeat", "TTFT repeat / new", "greedy = HF"]
    assert rows[1].endswith("| 6/6 |") and "(3)" in rows[1]


def test_the_command_line_reaches_the_bench():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "vision", "--shape", "tiny", "--num-requests", "4", "--record", "out.md"])
    assert (args.func, args.num_requests, args.output_len, args.hf_batch_size) == (commands.cmd_bench_vision, 4, 32, 8)
