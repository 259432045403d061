"""Beam search against Hugging Face's, sequence by sequence and score by score.

Each configuration of the grid is one case: ``LLM.beam_search`` with those
``BeamSearchParams`` against transformers' ``generate(num_beams=W,
do_sample=False, num_return_sequences=W)`` with the same width, length penalty,
``early_stopping`` and EOS rule, one prompt at a time (no padding). A
generation is the best hypothesis, its runners-up the other ``W - 1``, each
with its ranking score (HF's ``sequences_scores``).

The two ways of ignoring EOS map to HF as: ``min_tokens`` -> ``min_new_tokens``
(EOS forbidden), ``ignore_eos`` -> ``eos_token_id=None`` (EOS an ordinary
token). A width of 1 is compared with HF's ``num_beams=1``, which is greedy
search; the two coincide except under ``early_stopping="never"`` with a
positive length penalty (greedy stops at EOS; that beam search looks on), so
the grid has no such configuration.

Prompts are real-text passages asked about in the model's chat template ("In
a few words, what is this about?"): an instruct model answers and ends with
EOS within a few dozen tokens, so EOS, the length penalty and the stopping
rules all take part (raw prose almost never reaches EOS that soon).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pagedllm import BeamSearchParams
from pagedllm.bench.hf_reference import load_hf_model
from pagedllm_dev.differential.compare import Generation
from pagedllm_dev.differential.generations import cut_after_eos, eos_ids
from pagedllm_dev.differential.harness import DifferentialCase

if TYPE_CHECKING:
    from pagedllm_dev.differential.cases import CaseOptions

QUESTION = "In a few words, what is this about? "


def beam_grid(max_tokens: int) -> list[BeamSearchParams]:
    """Every width 1-8, EOS active, forbidden (HF) and ordinary (vLLM), length
    penalties from -0.5 to 2 and all three ``early_stopping`` modes, in
    configurations that cover each value without the full product."""
    half = max_tokens // 2
    grid = [
        (1, {}, 1.0, False),
        (1, {"min_tokens": max_tokens}, 1.0, False),
        (2, {}, 1.0, False),
        (2, {"ignore_eos": True}, 0.0, True),
        (3, {}, 0.0, "never"),
        (4, {"min_tokens": max_tokens}, 1.0, False),
        (4, {"ignore_eos": True}, 1.0, False),
        (5, {}, 2.0, True),
        (6, {}, -0.5, False),
        (7, {}, 1.0, "never"),
        (8, {}, 0.5, True),
        (8, {"min_tokens": half}, 2.0, "never"),
    ]
    return [BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty,
                             early_stopping=stopping, **eos_rule)
            for width, eos_rule, penalty, stopping in grid]


def describe(params: BeamSearchParams) -> str:
    """A case name: the parameters that differ between configurations."""
    eos = ("ignore_eos" if params.ignore_eos else f"min_tokens={params.min_tokens}" if params.min_tokens
           else "eos")
    return (f"beam W={params.beam_width} {eos} lp={params.length_penalty} "
            f"early_stopping={params.early_stopping} T={params.max_tokens}")


def ask_about(tokenizer, passage: str) -> list[int]:
    """The chat-template ids of a question about ``passage`` (what both sides run)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION + passage}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text)


def engine_beam(llm, prompts: list[str], params: BeamSearchParams) -> list[Generation]:
    """One ``LLM.beam_search`` call over all prompts (their groups batched)."""
    ids = [ask_about(llm.get_tokenizer(), prompt) for prompt in prompts]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in ids], params)
    generations = []
    for prompt_ids, output in zip(ids, outputs):
        ranked = [Generation(tuple(s.tokens[len(prompt_ids):]), s.score) for s in output.sequences]
        generations.append(replace(ranked[0], runners_up=tuple(ranked[1:])))
    return generations


@torch.inference_mode()
def hf_beam(hf_model, tokenizer, prompts: list[str], params: BeamSearchParams) -> list[Generation]:
    """transformers' beam search on each prompt alone, all ``W`` hypotheses."""
    eos = [] if params.ignore_eos else eos_ids(hf_model)
    generations = []
    for passage in prompts:
        ids = ask_about(tokenizer, passage)
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=params.beam_width, num_return_sequences=params.beam_width, do_sample=False,
            max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens,
            length_penalty=params.length_penalty, early_stopping=params.early_stopping,
            eos_token_id=eos or None, pad_token_id=eos_ids(hf_model)[0],
            output_scores=True, output_logits=params.beam_width == 1, return_dict_in_generate=True,
        )
        ranked = [_hf_hypothesis(out, row, len(ids), eos, params) for row in range(params.beam_width)]
        generations.append(replace(ranked[0], runners_up=tuple(ranked[1:])))
    return generations


def _hf_hypothesis(out, row: int, prompt_len: int, eos: list[int], params: BeamSearchParams) -> Generation:
    tokens = cut_after_eos(out.sequences[row, prompt_len:].tolist(), eos)
    if params.beam_width > 1:
        return Generation(tuple(tokens), out.sequences_scores[row].item())
    # num_beams=1 is greedy search, which reports no score: beam search's,
    # from the raw logits (HF's min_new_tokens masks EOS after log_softmax).
    logprob = sum(torch.log_softmax(logits[0].float(), dim=-1)[token].item()
                  for logits, token in zip(out.logits, tokens))
    return Generation(tuple(tokens), logprob / len(tokens) ** params.length_penalty)


def beam_vs_hf(options: CaseOptions) -> list[DifferentialCase]:
    """One case per configuration of ``beam_grid(options.max_tokens)``, all on
    one engine and one HF model."""
    llm = options.llm()
    hf_model = load_hf_model(options.model)
    tokenizer = llm.get_tokenizer()

    def case(params: BeamSearchParams) -> DifferentialCase:
        return DifferentialCase(describe(params), oracle=lambda prompts: hf_beam(hf_model, tokenizer, prompts, params),
                                feature=lambda prompts: engine_beam(llm, prompts, params), engines=(llm,))

    return [case(params) for params in beam_grid(options.max_tokens)]
