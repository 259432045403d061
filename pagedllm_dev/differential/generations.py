"""Generations from pagedllm and from Hugging Face transformers, in the
harness's one shape (``Generation``), for the same token ids."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams
from pagedllm_dev.differential.compare import Generation


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The ids both sides run, so tokenization can never be the difference."""
    return [tokenizer.encode(prompt) for prompt in prompts]


def engine_greedy(llm: LLM, prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> list[Generation]:
    """One greedy ``generate`` call over all prompts (continuous batching), with
    each chosen token's logprob. ``ignore_eos`` masks EOS for all ``max_tokens``
    (``min_tokens``), as HF's ``min_new_tokens`` does."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0,
                            min_tokens=max_tokens if ignore_eos else 0)
    ids = encode_prompts(llm.get_tokenizer(), prompts)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    generations = []
    for output in outputs:
        completion = output.outputs[0]
        chosen = tuple(position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids))
        generations.append(Generation(tuple(completion.token_ids), completion.cumulative_logprob, chosen))
    return generations


@torch.inference_mode()
def hf_greedy(hf_model, tokenizer, prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> list[Generation]:
    """transformers ``generate(do_sample=False)``, one prompt at a time (no
    padding), cut after its first EOS; logprobs from its raw logits."""
    generations = []
    for ids in encode_prompts(tokenizer, prompts):
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens if ignore_eos else 0, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
        tokens = cut_after_eos(out.sequences[0, len(ids):].tolist(), eos_ids(hf_model))
        logprobs = tuple(torch.log_softmax(logits[0].float(), dim=-1)[token].item()
                         for logits, token in zip(out.logits, tokens))
        generations.append(Generation(tuple(tokens), sum(logprobs), logprobs))
    return generations


def eos_ids(hf_model) -> list[int]:
    eos = hf_model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def cut_after_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """HF pads a sequence that ended early; pagedllm's stops at its EOS."""
    ends = [i for i, token in enumerate(tokens) if token in eos]
    return tokens[: ends[0] + 1] if ends else tokens

