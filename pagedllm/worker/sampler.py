"""Turn one engine step's logits into tokens, with vLLM's sampling semantics.

Per row, in this order:

1. Penalties, on the raw logits:
   - ``repetition_penalty`` (HF/vLLM rule) over every token that occurs in the
     prompt or the output: a positive logit is divided by the penalty, a
     negative one multiplied by it.
   - ``frequency_penalty``: subtract ``penalty * count`` of the token in the
     output (the prompt does not count).
   - ``presence_penalty``: subtract ``penalty`` once if the token occurs in the
     output.
2. ``min_tokens``: while fewer than ``min_tokens`` tokens have been generated,
   the EOS ids and ``stop_token_ids`` get ``-inf`` (``ignore_eos`` does not
   matter here; it only decides whether EOS stops the sequence).
3. Greedy rows (``params.is_greedy``) take the argmax.
4. Other rows: divide by ``temperature``, then
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
("raw_logprobs"). A ``Logprob.rank`` is 1 + the number of tokens with a
strictly greater logprob, so tied tokens share a rank.

Reproducibility: the randomness of a row depends only on its
``(seed, output position)``: that pair is mixed into the seed of a private
``torch.Generator``, which draws exponential noise ``E`` over the vocabulary,
and the token is ``argmax(probs / E)`` (the exponential race, equivalent to
drawing from ``probs``). The same seed therefore gives the same text whatever
else is in the batch, in whatever row order, and after a preemption recomputes
the sequence.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.outputs import Logprob, PositionLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import mix_seed

# top_p looks for its cut among this many most likely tokens before sorting a whole row.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingMetadata:
    """One row per logits row to sample."""

    params: list[SamplingParams]
    # Effective seed of each request (the engine draws one when params.seed is None).
    seeds: list[int]
    # Index in the output of the token being sampled now (== len(output_token_ids[i])).
    output_positions: list[int]
    prompt_token_ids: list[list[int]]
    # Tokens generated so far by that sequence.
    output_token_ids: list[list[int]]


@dataclass
class SamplerOutput:
    """What one sampler call chose, one entry per logits row."""

    sampled_token_ids: list[int]
    # Logprob of each sampled token under the raw model distribution.
    sampled_logprobs: list[float]
    # None unless params.logprobs is not None: {sampled id: Logprob, + top-k ids}.
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """Samples one token per logits row; stateless apart from the EOS ids."""

    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample every row of ``logits`` ([num_rows, vocab]): float32, or the
        model's bf16/fp16, read as fp32. Low-precision logits go to fp32 first
        unless every row only needs the argmax and the sampled logprob, which
        are read from them directly (the upcast is exact, so the tokens are the
        same; the logprobs agree to fp32 rounding).

        The caller's tensor is never modified in place.
        """
        _check_batch(logits, metadata)
        if logits.dtype != torch.float32 and not all(p.is_greedy and p.logprobs is None for p in metadata.params):
            logits = logits.float()
        processed = _process_logits(logits, metadata, self.eos_token_ids)
        greedy_ids, log_normalizer = _argmax_logsumexp(processed)
        if processed is not logits:
            log_normalizer = _argmax_logsumexp(logits)[1]
        token_ids = _sample(processed, metadata, greedy_ids)

        # The sampled token's raw logprob is logit - logsumexp: one reduction, no
        # full [rows, vocab] log_softmax unless some row asked for top-k logprobs.
        sampled = token_ids.tolist()
        sampled_logprobs = (logits.gather(1, token_ids[:, None]).squeeze(1) - log_normalizer).tolist()
        logprobs: list[PositionLogprobs | None] = [None] * len(metadata.params)
        rows = [i for i, p in enumerate(metadata.params) if p.logprobs is not None]
        if rows:
            entries = _position_logprobs(
                torch.log_softmax(_take_rows(logits, rows), dim=-1),
                _take_rows(token_ids, rows),
                [metadata.params[i].logprobs for i in rows],
            )
            for row, entry in zip(rows, entries):
                logprobs[row] = entry
                # One value per token: the reported entry and the cumulative sum agree exactly.
                sampled_logprobs[row] = entry[sampled[row]].logprob
        return SamplerOutput(sampled_token_ids=sampled, sampled_logprobs=sampled_logprobs, logprobs=logprobs)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: list[int], num_logprobs: int
) -> list[PositionLogprobs]:
    """Logprobs of prompt tokens: ``logits[i]`` predicts ``target_token_ids[i]``.

    Returns, per position, ``{target id: Logprob}`` plus the ``num_logprobs``
    most likely tokens, all from ``log_softmax(logits[i])``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_token_ids):
        raise ValueError(
            f"logits must be [len(target_token_ids)={len(target_token_ids)}, vocab], "
            f"got shape {tuple(logits.shape)}"
        )
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    if not target_token_ids:
        return []
    targets = torch.tensor(target_token_ids, device=logits.device)
    return _position_logprobs(
        torch.log_softmax(logits.float(), dim=-1), targets, [num_logprobs] * len(target_token_ids)
    )


def _check_batch(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    lengths = {
        "params": len(metadata.params),
        "seeds": len(metadata.seeds),
        "output_positions": len(metadata.output_positions),
        "prompt_token_ids": len(metadata.prompt_token_ids),
        "output_token_ids": len(metadata.output_token_ids),
    }
    wrong = {name: n for name, n in lengths.items() if n != num_rows}
    if wrong:
        raise ValueError(
            f"SamplingMetadata lists must have one entry per logits row ({num_rows}), got {wrong}"
        )


def _filter_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    uses: Callable[[SamplingParams], bool],
    apply: Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor],
) -> torch.Tensor:
    """Run ``apply`` on the rows whose params satisfy ``uses``; skip it if none do.

    Writes into ``logits``, which must be the sampler's own tensor.
    """
    rows = [i for i, p in enumerate(params) if uses(p)]
    if not rows:
        return logits
    if len(rows) == len(params):
        return apply(logits, params)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = apply(logits[index], [params[i] for i in rows])
    return logits


def _take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tensor[rows]`` for increasing distinct ``rows``; the tensor itself (no copy)
    when that is every row, so read-only callers skip a gather."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[torch.tensor(rows, device=tensor.device)]


def _row_values(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """A [rows, 1] column on ``like``'s device, to broadcast one value per row."""
    return torch.tensor(values, device=like.device)[:, None]


# ---------------------------------------------------------------------------
# Steps 1-2: penalties and min_tokens.
# ---------------------------------------------------------------------------


def _process_logits(
    logits: torch.Tensor, metadata: SamplingMetadata, eos_token_ids: list[int]
) -> torch.Tensor:
    """Penalties then the min_tokens mask, on a copy made only if some row needs either."""
    params = metadata.params
    penalty_rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    mask_rows, mask_cols = _min_tokens_mask(metadata, eos_token_ids, logits.shape[1])
    if not penalty_rows and not mask_rows:
        return logits
    processed = logits.to(torch.float32, copy=True)  # penalties and masks always work in fp32
    device = logits.device
    if penalty_rows:
        index = torch.tensor(penalty_rows, device=device)
        processed[index] = _penalize(
            processed[index],
            [params[i] for i in penalty_rows],
            [metadata.prompt_token_ids[i] for i in penalty_rows],
            [metadata.output_token_ids[i] for i in penalty_rows],
        )
    if mask_rows:
        rows = torch.tensor(mask_rows, device=device)
        processed[rows, torch.tensor(mask_cols, device=device)] = -math.inf
    return processed


def _penalize(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty (vLLM's order), batched."""
    vocab = logits.shape[1]
    if any(p.repetition_penalty != 1.0 for p in params):
        # Prompt tokens count for the repetition penalty only.
        seen_ids = [prompt + output for prompt, output in zip(prompt_token_ids, output_token_ids)]
        seen = _token_counts(seen_ids, vocab, logits.device, dtype=torch.bool)
        repetition = _row_values([p.repetition_penalty for p in params], logits)
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, scaled, logits)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        counts = _token_counts(output_token_ids, vocab, logits.device, dtype=logits.dtype)
        frequency = _row_values([p.frequency_penalty for p in params], logits)
        presence = _row_values([p.presence_penalty for p in params], logits)
        logits = logits - frequency * counts - presence * (counts > 0)
    return logits


def _token_counts(
    token_ids: list[list[int]], vocab: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[len(token_ids), vocab]: how often each id occurs in each list (or whether, for bool)."""
    counts = torch.zeros(len(token_ids), vocab, dtype=dtype, device=device)
    flat = list(itertools.chain.from_iterable(token_ids))
    if flat:
        rows = torch.repeat_interleave(
            torch.arange(len(token_ids), device=device),
            torch.tensor([len(ids) for ids in token_ids], device=device),
        )
        ids = torch.tensor(flat, device=device)
        ones = torch.ones(len(flat), dtype=dtype, device=device)
        # Only counts need accumulating; a bool mask just needs the writes.
        counts.index_put_((rows, ids), ones, accumulate=dtype != torch.bool)
    return counts


def _min_tokens_mask(
    metadata: SamplingMetadata, eos_token_ids: list[int], vocab: int
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to set to -inf: EOS and stop_token_ids of rows below min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (params, position) in enumerate(zip(metadata.params, metadata.output_positions)):
        if position >= params.min_tokens:
            continue
        # An id outside the logits can never be sampled, so there is nothing to mask.
        stop_ids = {t for t in (*eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab}
        rows.extend([i] * len(stop_ids))
        cols.extend(stop_ids)
    return rows, cols


# ---------------------------------------------------------------------------
# Steps 3-4: greedy and random sampling.
# ---------------------------------------------------------------------------


def _argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first argmax and the fp32 logsumexp, in one C++ pass over the
    logits on CPU (PyTorch needs two, and a [rows, vocab] temporary)."""
    kernels = cpu_kernels_for(logits)
    if kernels is not None and logits.dtype in (torch.float32, torch.bfloat16):
        return kernels.argmax_logsumexp(logits)
    logits = logits.float()
    return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)


def _sample(logits: torch.Tensor, metadata: SamplingMetadata, greedy_ids: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 token ids: ``greedy_ids`` (the argmax of ``logits``,
    overwritten here) for greedy rows, a seeded draw for the others."""
    params = metadata.params
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    token_ids = greedy_ids
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        token_ids[index] = _sample_random(
            _take_rows(logits, random_rows),
            [params[i] for i in random_rows],
            [metadata.seeds[i] for i in random_rows],
            [metadata.output_positions[i] for i in random_rows],
        )
    return token_ids


def _sample_random(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, then the exponential race with per-row noise."""
    vocab = logits.shape[1]
    scaled = logits / _row_values([p.temperature for p in params], logits)
    scaled = _filter_rows(scaled, params, lambda p: 0 < p.top_k < vocab, _apply_top_k)
    scaled = _filter_rows(scaled, params, lambda p: p.top_p < 1.0, _apply_top_p)
    scaled = _filter_rows(scaled, params, lambda p: p.min_p > 0.0, _apply_min_p)
    probs = scaled.softmax(dim=-1)
    noise = _exponential_noise(seeds, positions, vocab, logits.device)
    return (probs / noise).argmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep tokens whose logit is >= the row's k-th largest (ties with the k-th are kept)."""
    top_k = [p.top_k for p in params]
    kth = logits.topk(max(top_k), dim=-1).values.gather(1, _row_values(top_k, logits) - 1)
    return logits.masked_fill(logits < kth, -math.inf)


def _apply_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p.

    The top token is always kept, and so are tokens tied with the least likely
    kept one. The cut nearly always falls within the most likely
    ``_TOP_P_CANDIDATES`` tokens, and a top-k of those is far cheaper than
    sorting the vocabulary, so only rows whose candidates fall short of top_p
    are fully sorted.
    """
    top_p = _row_values([p.top_p for p in params], logits)
    log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    num_candidates = min(logits.shape[1], _TOP_P_CANDIDATES)
    candidates = logits.topk(num_candidates, dim=-1).values
    cutoff, reached = _top_p_cutoff(candidates, log_normalizer, top_p)
    if num_candidates < logits.shape[1]:
        short = (~reached).nonzero().squeeze(1)
        if short.numel() > 0:
            sorted_logits = logits[short].sort(dim=-1, descending=True).values
            cutoff[short] = _top_p_cutoff(sorted_logits, log_normalizer[short], top_p[short])[0]
    return logits.masked_fill(logits < cutoff, -math.inf)


def _top_p_cutoff(
    sorted_logits: torch.Tensor, log_normalizer: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of the most likely logits in decreasing order: the logit of the
    last token of the smallest prefix whose mass reaches top_p ([rows, 1]), and
    whether these columns hold enough mass to reach it ([rows]).

    A token belongs to the prefix when the mass before it is < top_p, which
    always includes the first token.
    """
    probs = (sorted_logits - log_normalizer).exp()
    cumulative = probs.cumsum(dim=-1)
    prefix_length = (cumulative - probs < top_p).sum(dim=-1, keepdim=True)
    return sorted_logits.gather(1, prefix_length - 1), cumulative[:, -1] >= top_p[:, 0]


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability is < min_p * the top probability.

    Done in logit space, which saves a softmax:
    p_i < min_p * p_max  <=>  x_i < x_max + log(min_p).
    """
    log_min_p = _row_values([math.log(p.min_p) for p in params], logits)
    threshold = logits.max(dim=-1, keepdim=True).values + log_min_p
    return logits.masked_fill(logits < threshold, -math.inf)


def _exponential_noise(
    seeds: list[int], positions: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(seeds), vocab] Exp(1) noise; row i depends only on (seeds[i], positions[i])."""
    noise = torch.empty(len(seeds), vocab, device=device)
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        generator = torch.Generator(device=device)
        generator.manual_seed(mix_seed(seed, position))
        noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would make a masked token's 0 / 0 a NaN, which argmax
    # would pick as the maximum.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


# ---------------------------------------------------------------------------
# Logprobs.
# ---------------------------------------------------------------------------


def _position_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[PositionLogprobs]:
    """Per row: {token id: Logprob} for token_ids[row], then the num_top[row] most likely.

    The chosen token comes first; a top token equal to it is not repeated, so a
    row has num_top or num_top + 1 entries.
    """
    chosen = logprobs.gather(1, token_ids[:, None])
    chosen_ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1)
    result: list[PositionLogprobs] = []
    for token, value, rank, values, ids, k in zip(
        token_ids.tolist(),
        chosen.squeeze(1).tolist(),
        chosen_ranks.tolist(),
        top_values.tolist(),
        top_ids.tolist(),
        num_top,
    ):
        entry: PositionLogprobs = {token: Logprob(logprob=value, rank=rank)}
        for top_id, top_value, top_rank in zip(ids[:k], values[:k], _descending_ranks(values[:k])):
            entry.setdefault(top_id, Logprob(logprob=top_value, rank=top_rank))
        result.append(entry)
    return result


def _descending_ranks(values: list[float]) -> list[int]:
    """Ranks of a list sorted in decreasing order: 1 + the number of strictly greater values."""
    ranks: list[int] = []
    for j, value in enumerate(values):
        ranks.append(ranks[-1] if j > 0 and value == values[j - 1] else j + 1)
    return ranks
