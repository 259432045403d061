"""Pool sizing from the device: vLLM's gpu_memory_utilization arithmetic and the profiling step."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.attention.kv_cache import allocate_layer
from pagedllm.attention.selector import attention_backend_for
from pagedllm.model.shapes import head_dim_of
from pagedllm.worker.memory import run_dummy_step, utilization_kv_budget

GIB = 2**30


def test_utilization_budget_is_what_weights_and_activations_leave():
    assert utilization_kv_budget(80 * GIB, 0.9, 16 * GIB, 2 * GIB) == int(72 * GIB) - 18 * GIB


def test_utilization_budget_with_no_room_names_what_to_change():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization or lower max_num_batched_tokens") as info:
        utilization_kv_budget(10 * GIB, 0.5, 4 * GIB, 1 * GIB)
    assert "allows 5.00 GiB" in str(info.value) and "weights take 4.00 GiB" in str(info.value)


def test_gpu_memory_utilization_is_refused_on_cpu(tiny_llama):
    with pytest.raises(ValueError, match="gpu_memory_utilization applies to CUDA devices"):
        LLM(tiny_llama, device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        LLM(tiny_llama, gpu_memory_utilization=0.0)


def test_dummy_step_writes_every_token_into_its_throwaway_pool(tiny_llama, monkeypatch):
    """The profiling step is a real forward of the largest step: it must store
    K/V for all of its tokens (so the attention path it measures is the real one)."""
    from pagedllm.worker import memory

    llm = LLM(tiny_llama, num_kv_blocks=8, device="cpu")
    model = llm.llm_engine.model
    config = llm.llm_engine.model_config
    layers = []

    def recording_allocate(*args, **kwargs):
        layers.append(allocate_layer(*args, **kwargs))
        return layers[-1]

    monkeypatch.setattr(memory, "allocate_layer", recording_allocate)
    run_dummy_step(model, attention_backend_for(torch.device("cpu"), 16), num_tokens=40, num_logit_rows=8,
                   block_size=16, kv_shape=(config.num_key_value_heads, head_dim_of(config)),
                   dtype=torch.float32, kv_cache_dtype="auto", device=torch.device("cpu"))
    assert len(layers) == config.num_hidden_layers
    for layer in layers:
        for pool in (layer.key, layer.value):
            assert pool.shape[:2] == (3, 16)
            written = pool.view(48, -1).abs().sum(-1) > 0
            assert written[:40].all() and not written[40:].any()
