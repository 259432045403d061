"""The llama.cpp column of `pagedllm bench hybrid-kv`: reading the KV caches from a real
llama-server log (lines captured from the llama.cpp llama-cpp-python 0.3.36 vendors, on the Gemma 3 270M GGUF),
the slot search, and the choice of the server binary. No server is started here."""

from __future__ import annotations

import pytest

from pagedllm.bench.llama_server_kv import KVCache, find_llama_server, kv_bytes, most_slots, parse_kv_log

# llama-server -c 4096 -np 1 --kv-unified -ctk f32 -ctv f32 -lv 4 (its SWA cache: 1024 cells of the 15 local layers).
SWA_LOG = """\
0.01.073.369 I llama_context: n_ctx                 = 4096
0.01.073.382 I llama_context: n_ctx_seq             = 4096
0.01.073.395 I llama_context: n_batch               = 2048
0.01.073.408 I llama_context: n_ubatch              = 512
0.01.073.421 I llama_context: causal_attn           = 1
0.01.073.435 I llama_context: flash_attn            = auto
0.01.073.478 I llama_context: kv_unified            = true
0.01.073.500 I llama_context: freq_base             = 1000000.0
0.01.073.514 I llama_context: freq_scale            = 1
0.01.073.527 I llama_context: n_rs_seq              = 0
0.01.073.540 I llama_context: n_outputs_max         = 1
0.01.073.553 I llama_context: n_outputs_max_per_seq = 1
0.01.073.566 I llama_context: n_ctx_seq (4096) < n_ctx_train (32768) -- the full capacity of the model will not be utilized
0.01.073.666 I llama_context:        CPU  output buffer size =     1.00 MiB
0.01.073.700 I llama_kv_cache_iswa: creating non-SWA KV cache, size = 4096 cells
0.01.073.808 I llama_kv_cache:        CPU KV buffer size =    24.00 MiB
0.01.099.325 I llama_kv_cache: size =   24.00 MiB (  4096 cells,   3 layers,  1/1 seqs), K (f32):   12.00 MiB, V (f32):   12.00 MiB
0.01.101.384 I llama_kv_cache: attn_rot_k = 0, n_embd_head_k_all = 256
0.01.101.398 I llama_kv_cache: attn_rot_v = 0, n_embd_head_k_all = 256
0.01.101.415 I llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
0.01.101.499 I llama_kv_cache:        CPU KV buffer size =    30.00 MiB
0.01.135.702 I llama_kv_cache: size =   30.00 MiB (  1024 cells,  15 layers,  1/1 seqs), K (f32):   15.00 MiB, V (f32):   15.00 MiB
0.01.135.768 I llama_kv_cache: attn_rot_k = 0, n_embd_head_k_all = 256
0.01.135.786 I llama_kv_cache: attn_rot_v = 0, n_embd_head_k_all = 256
"""

# The same with --swa-full (its warning and cache lines): the SWA cache is as long as the context.
SWA_FULL_LOG = """\
0.01.117.398 W llama_kv_cache_iswa: using full-size SWA cache (ref: https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055)
0.01.142.309 I llama_kv_cache: size =   24.00 MiB (  4096 cells,   3 layers,  1/1 seqs), K (f32):   12.00 MiB, V (f32):   12.00 MiB
0.01.279.415 I llama_kv_cache: size =  120.00 MiB (  4096 cells,  15 layers,  1/1 seqs), K (f32):   60.00 MiB, V (f32):   60.00 MiB
"""


def test_parse_swa_and_swa_full_logs() -> None:
    swa = parse_kv_log(SWA_LOG)
    assert [(c.cells, c.layers) for c in swa] == [(4096, 3), (1024, 15)]
    full = parse_kv_log(SWA_FULL_LOG)
    assert [(c.cells, c.layers) for c in full] == [(4096, 3), (4096, 15)]
    # f32 K and V of one 256-wide KV head: 2 KiB per cell and layer.
    assert kv_bytes(swa) == (4096 * 3 + 1024 * 15) * 2048
    assert kv_bytes(full) == 4096 * 18 * 2048


def test_a_log_without_kv_lines_is_an_error() -> None:
    with pytest.raises(ValueError, match="llama_kv_cache: size"):
        parse_kv_log("main: loading model\nerror: unknown argument: --swa-full\n")


@pytest.mark.parametrize("limit, estimate", [(9, 9), (9, 5), (9, 14), (0, 3), (1, 0)])
def test_most_slots_finds_the_largest_that_fits(limit: int, estimate: int) -> None:
    tried = []

    def fits(slots: int) -> bool:
        tried.append(slots)
        return slots <= limit

    assert most_slots(fits, estimate) == limit
    assert len(tried) <= abs(limit - max(1, estimate)) + 2


def test_the_server_binary(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server(None) is None
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match="not an executable"):
        find_llama_server(str(binary))
    binary.chmod(0o755)
    assert find_llama_server(None) == find_llama_server(str(binary)) == str(binary)
    assert kv_bytes([KVCache(1.5, 1, 1)]) == 3 << 19
