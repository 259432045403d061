"""Engine construction seen from tensor parallelism: a worker loads its shard
exactly as the engine loads rank 0's, and the distributed package stands below
the engine and the runner (it imports neither)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import pagedllm
from pagedllm.config.engine import CacheConfig, EngineConfig
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.model.sharding import shard_layout
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.worker import rank as rank_builder
from pagedllm.worker import tp_worker as worker
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.runner_spec import RunnerSpec


def run_worker_in_process(config: EngineConfig, spec: RunnerSpec, rank: int, world_size: int, monkeypatch) -> list:
    """``worker_main`` with torch.distributed replaced by the driver's three
    broadcasts (configuration, runner spec, stop); returns the runners it built."""
    broadcasts = [config, spec, None]

    def receive_from_driver(box: list, src: int) -> None:
        box[0] = broadcasts.pop(0)

    monkeypatch.setattr(worker.dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(worker.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(worker.dist, "broadcast_object_list", receive_from_driver)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # keep this process's threads
    runners = []

    def recording_runner(*args, **kwargs) -> ModelRunner:
        runners.append(ModelRunner(*args, **kwargs))
        return runners[-1]

    monkeypatch.setattr(rank_builder, "ModelRunner", recording_runner)
    worker.worker_main(rank, world_size, "tcp://127.0.0.1:1", 10.0, "cpu")
    assert broadcasts == []
    return runners


def test_a_worker_builds_its_rank_of_the_model_the_engine_loads(tiny_llama, monkeypatch):
    """Same checkpoint, same max_model_len (the engine's 64, not the model's
    4096-token window): rank 1's shard is rank 1's cut of the engine's weights."""
    monkeypatch.setenv("PAGEDLLM_PACKED_LINEAR", "0")  # compared in nn.Linear's [out, in] layout
    engine = LLMEngine(EngineConfig(model=tiny_llama, max_model_len=64, cache=CacheConfig(num_kv_blocks=8)))
    (runner,) = run_worker_in_process(engine.config, engine.runner_spec, rank=1, world_size=2, monkeypatch=monkeypatch)
    rank1, whole = runner.model, engine.model
    # The driver's runner spec: the same blocks, each holding this rank's KV heads.
    assert runner.kv_caches[0].key.shape[0] == engine.runner.kv_caches[0].key.shape[0] == 8
    assert runner.kv_caches[0].key.shape[2] == rank1.num_kv_heads
    assert rank1.tp == TensorParallelGroup(rank=1, world_size=2)
    whole_attention, rank1_attention = whole.model.layers[0].self_attn, rank1.model.layers[0].self_attn
    assert engine.max_model_len == 64
    assert rank1_attention.rotary.cos_cache.shape[0] == whole_attention.rotary.cos_cache.shape[0] == 64
    assert torch.equal(rank1.model.embed_tokens.weight, whole.model.embed_tokens.weight)
    layout = shard_layout(engine.model_config, rank1.tp)
    q, k, v = whole_attention.qkv_proj.weight.split(
        [whole_attention.q_size, whole_attention.kv_size, whole_attention.kv_size])
    expected_qkv = torch.cat([q[layout.q_rows], k[layout.kv_rows], v[layout.kv_rows]])
    assert torch.equal(rank1_attention.qkv_proj.weight, expected_qkv)
    assert torch.equal(rank1_attention.o_proj.weight, whole_attention.o_proj.weight[:, layout.q_rows])


def test_the_distributed_package_never_imports_the_engine_or_the_runner():
    """Import every ``pagedllm.distributed`` module in a fresh interpreter, with
    the package's ``__init__`` (which imports the engine for the public API)
    left out: no ``pagedllm.engine`` or ``pagedllm.worker`` module may come along
    (the rank loop that builds a runner lives in ``pagedllm.worker.tp_worker``)."""
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys, types
        package = types.ModuleType("pagedllm")
        package.__path__ = [{pagedllm.__path__[0]!r}]
        sys.modules["pagedllm"] = package
        import pagedllm.distributed
        for module in pkgutil.iter_modules(pagedllm.distributed.__path__):
            importlib.import_module("pagedllm.distributed." + module.name)
        print(sorted(name for name in sys.modules if name.startswith(("pagedllm.engine", "pagedllm.worker"))))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
