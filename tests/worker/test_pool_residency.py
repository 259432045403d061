"""The KV pool is reserved, not written, at start: a fresh process's resident
memory grows with the blocks its requests fill, not with the pool's size, and
``kv_cache_pretouch`` pays for the whole pool up front. Measured in a fresh
process (as tests/model/test_load_memory.py does) on the default model with a
1 GiB pool."""

import json
import subprocess
import sys

import pytest

from pagedllm import LLM
from pagedllm.worker import block_moves
from pagedllm.kv_tiers.host import HostKVStore
from tests.poisoned_pool import poison_layer, poison_tensor

POOL_BYTES = 2**30

_MEASURE = """
import json, sys
from pagedllm import LLM, SamplingParams

def rss_bytes():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS:")).split()[1]) * 1024

imported = rss_bytes()
llm = LLM(kv_cache_memory=int(sys.argv[1]), kv_cache_pretouch=sys.argv[2] == "1")
built = rss_bytes()
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate([f"Request {i}: count to ten." for i in range(4)], params, use_tqdm=False)
plan, stats = llm.llm_engine.pool_plan, llm.stats()
print(json.dumps({"imported": imported, "built": built, "served": rss_bytes(),
                  "pool": plan.num_blocks * plan.block_size * plan.bytes_per_token,
                  "all_free": stats["num_free_blocks"] == stats["num_blocks"]}))
"""


def _measure(pretouch: bool) -> dict[str, int]:
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(POOL_BYTES), str(int(pretouch))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured.pop("all_free"), "the engine kept blocks after its requests finished"
    return measured


@pytest.fixture(scope="module")
def lazy() -> dict[str, int]:
    return _measure(pretouch=False)


def test_a_new_engine_holds_its_weights_not_its_pool(lazy):
    assert 0.99 * POOL_BYTES <= lazy["pool"] <= POOL_BYTES
    # Weights (~100 MB packed), tokenizer and kernels; a written pool would add the whole GiB.
    assert lazy["built"] - lazy["imported"] < 0.3 * POOL_BYTES, lazy


def test_resident_memory_grows_with_the_blocks_written(lazy):
    # 4 requests of ~40 tokens fill ~12 blocks (~8 MiB of the 1 GiB pool).
    assert lazy["served"] - lazy["built"] < 0.1 * POOL_BYTES, lazy


@pytest.mark.slow
def test_pretouch_makes_the_whole_pool_resident_at_start(lazy):
    pretouched = _measure(pretouch=True)
    assert pretouched["built"] - lazy["built"] >= 0.95 * POOL_BYTES, (lazy, pretouched)
    assert pretouched["served"] - lazy["served"] >= 0.9 * POOL_BYTES, (lazy, pretouched)


def test_pretouch_writes_every_tensor_of_the_pool_and_the_swap_space(tiny_llama, monkeypatch):
    """Allocations filled with NaN (fresh pages would read as zeros anyway) come out all zeros."""
    allocate_layer, store_init = block_moves.allocate_layer, HostKVStore.__init__

    def poisoned_layer(*args, **kwargs):
        layer = allocate_layer(*args, **kwargs)
        poison_layer(layer)
        return layer

    def poisoned_store(self, *args, **kwargs):
        store_init(self, *args, **kwargs)
        poison_tensor(self.swap_rows)

    monkeypatch.setattr(block_moves, "allocate_layer", poisoned_layer)
    monkeypatch.setattr(HostKVStore, "__init__", poisoned_store)
    options = dict(num_kv_blocks=16, kv_cache_dtype="int8", preemption_mode="swap", swap_space=0.001)
    for pretouch in (False, True):
        runner = LLM(tiny_llama, kv_cache_pretouch=pretouch, **options).llm_engine.runner
        tensors = [t for layer in runner.kv_caches for t in (*layer.tensors(), layer.tail_key, layer.tail_value)]
        tensors.append(runner.host_store.swap_rows)
        assert len(tensors) == 6 * len(runner.kv_caches) + 1 and runner.host_store.swap_rows.numel() > 0
        assert all(bool((t == 0).all()) == pretouch for t in tensors)
