"""Turn one engine step's logits into tokens, with vLLM's sampling semantics.

Per row, in this order:

0. The grammar mask of guided rows (structured output): tokens the row's
   grammar does not allow next get ``-inf``, in the caller's tensor; other
   rows are not touched.
1. Token rules, on the raw logits (vLLM's order, ``sampling/token_rules.py``):
   ``allowed_token_ids`` masks every other token, ``bad_words`` mask a word's
   last token after the rest of it, ``logit_bias`` is added.
2. Penalties:
   - ``repetition_penalty`` (HF/vLLM rule) over every token that occurs in the
     prompt or the output: a positive logit is divided by the penalty, a
     negative one multiplied by it.
   - ``frequency_penalty``: subtract ``penalty * count`` of the token in the
     output (the prompt does not count).
   - ``presence_penalty``: subtract ``penalty`` once if the token occurs in the
     output.
3. ``min_tokens``: while fewer than ``min_tokens`` tokens have been generated,
   the EOS ids and ``stop_token_ids`` get ``-inf`` (``ignore_eos`` does not
   matter here; it only decides whether EOS stops the sequence).
4. Greedy rows (``params.is_greedy``) take the argmax.
5. Other rows: divide by ``temperature``, then
   - ``top_k`` (0 = off): keep tokens whose logit is >= the k-th largest;
   - ``top_p`` (1 = off), on the distribution renormalised after top_k: keep
     the smallest set of most likely tokens whose probability reaches
     ``top_p`` (the top token is always kept);
   - ``min_p`` (0 = off): drop tokens whose probability is
     < ``min_p * the top probability``;
   then draw from the softmax of what is left. Tokens tied with the last kept
   one are kept by top_k and top_p alike.

Reported logprobs (the sampled token's and the top-k ones) are ``log_softmax``
of the RAW logits, before penalties and temperature: vLLM v1's default
("raw_logprobs"). For a guided row they are taken after its grammar mask, as
vLLM does (it masks the logits before its sampler). A ``Logprob.rank`` is 1 +
the number of tokens with a strictly greater logprob, so tied tokens share a rank.

Reproducibility: the randomness of a row depends only on its
``(seed, output position)``: that pair is mixed into the seed of a private
``torch.Generator``, which draws exponential noise ``E`` over the vocabulary,
and the token is ``argmax(probs / E)`` (the exponential race, equivalent to
drawing from ``probs``). The same seed therefore gives the same text whatever
else is in the batch, in whatever row order, and after a preemption recomputes
the sequence.

The steps live in ``pagedllm.worker.sampling``: ``grammar`` (0), ``logits_processing``
with ``token_rules`` (1-3), ``draw`` (4-5) and ``logprobs``; this module puts them in order.
"""

from __future__ import annotations

import torch

from pagedllm.outputs import PositionLogprobs
from pagedllm.worker.sampling.draw import argmax_logsumexp, sample
from pagedllm.worker.sampling.grammar import RowBitmask, mask_guided_rows
from pagedllm.worker.sampling.logits_processing import process_logits
from pagedllm.worker.sampling.logprobs import compute_prompt_logprobs, position_logprobs
from pagedllm.worker.sampling.metadata import SamplerOutput, SamplingMetadata, check_batch
from pagedllm.worker.sampling.rows import take_rows

# The sampler's interface, kept importable from here for the model runner.
__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "compute_prompt_logprobs"]


class Sampler:
    """Samples one token per logits row; stateless apart from the EOS ids."""

    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, grammar: RowBitmask | None = None
    ) -> SamplerOutput:
        """Sample every row of ``logits`` ([num_rows, vocab]): float32, or the
        model's bf16/fp16, read as fp32. Low-precision logits go to fp32 first
        unless every row only needs the argmax and the sampled logprob, which
        are read from them directly (the upcast is exact, so the tokens are the
        same; the logprobs agree to fp32 rounding).

        ``grammar`` holds the masks of the guided rows, if any: those rows of
        ``logits`` are masked in place (so a batch pays nothing for its free
        rows). No other row of the caller's tensor is ever modified.
        """
        check_batch(logits, metadata)
        if grammar is not None:
            mask_guided_rows(logits, grammar)
        if logits.dtype != torch.float32 and not all(p.is_greedy and p.logprobs is None for p in metadata.params):
            logits = logits.float()
        processed = process_logits(logits, metadata, self.eos_token_ids)
        greedy_ids, log_normalizer = argmax_logsumexp(processed)
        if processed is not logits:
            log_normalizer = argmax_logsumexp(logits)[1]
        token_ids = sample(processed, metadata, greedy_ids)

        # The sampled token's raw logprob is logit - logsumexp: one reduction, no
        # full [rows, vocab] log_softmax unless some row asked for top-k logprobs.
        sampled = token_ids.tolist()
        sampled_logprobs = (logits.gather(1, token_ids[:, None]).squeeze(1) - log_normalizer).tolist()
        logprobs: list[PositionLogprobs | None] = [None] * len(metadata.params)
        rows = [i for i, p in enumerate(metadata.params) if p.logprobs is not None]
        if rows:
            entries = position_logprobs(
                torch.log_softmax(take_rows(logits, rows), dim=-1),
                take_rows(token_ids, rows),
                [metadata.params[i].logprobs for i in rows],
            )
            for row, entry in zip(rows, entries):
                logprobs[row] = entry
                # One value per token: the reported entry and the cumulative sum agree exactly.
                sampled_logprobs[row] = entry[sampled[row]].logprob
        return SamplerOutput(sampled_token_ids=sampled, sampled_logprobs=sampled_logprobs, logprobs=logprobs)
