"""Greedy parity against Hugging Face for tiny random checkpoints of any config:
the helpers the rope and architecture parity tests share.

Hugging Face runs each prompt alone (batch 1); pagedllm runs them all at once,
once with whole prefills and a cold cache, once with small chunks, then again
so that the prompts' full blocks come from the prefix cache.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from pagedllm import LLM, SamplingParams
from tests.conftest import assert_pool_free



def write_checkpoint(folder: Path, config: PretrainedConfig, tokenizer) -> str:
    """A random-weight checkpoint of ``config`` (TINY_COMMON's sizes unless it sets its own)
    with ``tokenizer`` beside it; no EOS, so every run generates its full length."""
    config.vocab_size = len(tokenizer)
    config.eos_token_id = config.pad_token_id = None  # (defaults such as SmolLM3's pad id lie past this vocabulary)
    torch.manual_seed(1234)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def random_eager_model(config: PretrainedConfig, norm_mean: float) -> torch.nn.Module:
    """A random fp32 model of ``config`` (seed 0) on Hugging Face's eager attention, its norm
    weights drawn around ``norm_mean`` (the default ones, or Gemma's zeros, would hide a norm
    that ignores its weight)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(norm_mean, 0.3)
    return model.eval()


def write_eager_model(folder: Path, config: PretrainedConfig, tokenizer) -> torch.nn.Module:
    """``random_eager_model`` with norm weights around 1, saved with ``tokenizer`` to
    ``folder``; returns it as the oracle."""
    model = random_eager_model(config, 1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def prompts(lengths: list[int], vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """Hugging Face's greedy continuation, with the rope as a freshly loaded model has it:
    dynamic NTK keeps the longest length it has seen, which would leak between prompts."""
    rope = hf_model.model.rotary_emb
    if hasattr(rope, "original_inv_freq"):
        rope.register_buffer("inv_freq", rope.original_inv_freq.clone(), persistent=False)
        rope.max_seq_len_cached = rope.original_max_seq_len
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_greedy_parity(folder: str, lengths: list[int], new_tokens: int, chunk: int = 16,
                        chunked_up_to: int | None = None, **llm_options) -> None:
    """pagedllm's greedy tokens equal Hugging Face's for every prompt: whole prefills, chunked
    prefills (``chunk`` tokens a step), and a second round served from the prefix cache.

    Prompts longer than ``chunked_up_to`` stay out of the chunked rounds: a length-dependent rope
    rotates each chunk by its own context length, as Hugging Face does when fed those chunks,
    not as it does for the whole prompt at once."""
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = prompts(lengths, hf_model.config.vocab_size)
    with torch.inference_mode():
        expected = [hf_greedy(hf_model, p, new_tokens) for p in batch]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    whole = LLM(folder, num_kv_blocks=256, debug_invariants=True, **llm_options)
    chunked = LLM(folder, num_kv_blocks=256, debug_invariants=True, max_num_batched_tokens=chunk,
                  max_num_seqs=4, **llm_options)
    limit = chunked_up_to or max(lengths)
    rounds = (("whole", whole, max(lengths)), ("chunked", chunked, limit), ("prefix cache", chunked, limit))
    for name, llm, longest in rounds:
        cases = [(p, tokens) for p, tokens in zip(batch, expected) if len(p) <= longest]
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], params, use_tqdm=False)
        for (prompt, tokens), output in zip(cases, outputs):
            assert output.outputs[0].token_ids == tokens, f"{name}: prompt of {len(prompt)} tokens"
    assert chunked.stats()["prefix_cache_hits"] > 0
    for llm in (whole, chunked):
        assert_pool_free(llm)
