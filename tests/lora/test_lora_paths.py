"""LoRA over every weight path: a llama.cpp GGUF LoRA file, GGUF base weights kept packed,
and the real SmolLM2 (its Q4_1 GGUF weights kept packed; bf16) against Hugging Face + PEFT
on real text."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.model.loader import default_model_path
from pagedllm_dev.differential.prompts import real_text_prompts
from tests.conftest import assert_pool_free, hf_model_copy
from tests.engine.test_hf_parity import assert_bf16_close_to_hf
from tests.lora.adapters import make_peft_adapter, peft_greedy, write_gguf_lora
from tests.model.test_quantized_engine import _tensor_type, _tiny_hf_model
from tests.model.test_loader import _write_gguf


def _greedy(llm: LLM, prompts: list[list[int]], loras, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_gguf_lora_file_runs_as_its_peft_folder(tiny_llama, smollm_tokenizer, tmp_path):
    peft_dir = make_peft_adapter(tiny_llama, str(tmp_path / "peft"), rank=8, seed=5)
    gguf_path = write_gguf_lora(peft_dir, str(tmp_path / "adapter.gguf"), "llama", base_dir=tiny_llama)
    prompts = [smollm_tokenizer.encode(t) for t in real_text_prompts(4, seed=7, max_words=40)]
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    from_gguf = _greedy(llm, prompts, LoRARequest("gguf", 1, gguf_path), 12)
    assert from_gguf == peft_greedy(tiny_llama, peft_dir, prompts, 12)
    fused = llm.llm_engine.runner.model.fused_decode  # LoRA projections: decode steps run op by op
    assert fused.checked and not fused.active
    assert_pool_free(llm)


def test_an_adapter_on_packed_gguf_weights_equals_it_on_dequantized_ones(tmp_path):
    """The LoRA product wraps whatever the base projection is: GGUF blocks kept packed give
    the same greedy tokens as the same file dequantized at load, with the adapter on both."""
    hf_model = _tiny_hf_model("llama")
    hf_model.save_pretrained(tmp_path / "hf")
    path = str(_write_gguf(tmp_path / "q.gguf", "llama", hf_model, tensor_type=_tensor_type))
    adapter = make_peft_adapter(str(tmp_path / "hf"), str(tmp_path / "adapter"), rank=8, seed=6)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]
    results = {}
    for mode in ("packed", "dequantize"):
        llm = LLM(path, gguf_weights=mode, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
        results[mode] = _greedy(llm, prompts, [LoRARequest("a", 1, adapter), None], 16)
        assert_pool_free(llm)
    assert results["packed"] == results["dequantize"]
    base = LLM(path, gguf_weights="packed", num_kv_blocks=64)
    assert _greedy(base, prompts[:1], None, 16) != results["packed"][:1]  # the adapter changed something


@pytest.fixture(scope="module")
def smollm_adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("smollm-adapters")
    base = default_model_path()
    return {"all16": make_peft_adapter(base, str(root / "all16"), rank=16, seed=11),
            "attn8": make_peft_adapter(base, str(root / "attn8"), rank=8, seed=12,
                                       targets=("q_proj", "k_proj", "v_proj", "o_proj")),
            # A fine-tune's update is small next to the weights: this one is 1/8 of their spread
            # (the others 1/2, to move greedy tokens), the scale bf16 rounding is judged at.
            "mild16": make_peft_adapter(base, str(root / "mild16"), rank=16, seed=13, scale=0.5)}


@pytest.mark.slow
def test_smollm2_greedy_per_adapter_and_mixed_equals_peft(smollm_adapters):
    llm = LLM(enable_lora=True, max_lora_rank=16, num_kv_blocks=1024)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in real_text_prompts(12, seed=3, max_words=60)]
    requests = {None: None, "all16": LoRARequest("all16", 1, smollm_adapters["all16"]),
                "attn8": LoRARequest("attn8", 2, smollm_adapters["attn8"])}
    oracle = {n: peft_greedy(default_model_path(), smollm_adapters.get(n), prompts, 20) for n in requests}
    names = [list(requests)[i % 3] for i in range(len(prompts))]  # one batch mixing both adapters and the base
    mixed = _greedy(llm, prompts, [requests[n] for n in names], 20)
    mismatches = [i for i, n in enumerate(names) if mixed[i] != oracle[n][i]]
    assert not mismatches, f"prompts {mismatches} differ from PEFT"
    assert _greedy(llm, prompts, requests["all16"], 20) == oracle["all16"]  # every prompt, one adapter
    assert all(oracle["all16"][i] != oracle[None][i] for i in range(4))
    assert_pool_free(llm)


@pytest.mark.slow
def test_smollm2_bf16_with_an_adapter_is_as_close_to_peft_as_hf_bf16(smollm_adapters):
    from peft import PeftModel

    llm = LLM(dtype="bfloat16", gguf_weights="dequantize", enable_lora=True, max_lora_rank=16, num_kv_blocks=1024)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in real_text_prompts(8, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=LoRARequest("mild16", 1, smollm_adapters["mild16"]))
    assert_pool_free(llm)
    oracle = PeftModel.from_pretrained(hf_model_copy(None, torch.float32), smollm_adapters["mild16"]).eval()
    hf_bf16 = PeftModel.from_pretrained(hf_model_copy(None, torch.bfloat16), smollm_adapters["mild16"]).eval()
    assert_bf16_close_to_hf(prompts, outputs, oracle, hf_bf16)
