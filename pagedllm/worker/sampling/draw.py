"""Steps 4-5 of sampling (see ``pagedllm.worker.sampler``): the greedy argmax,
and the seeded draw after temperature, top_k, top_p and min_p."""

from __future__ import annotations

import math

import torch

from pagedllm.kernels.cpu import cpu_kernels_for
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import mix_seed
from pagedllm.worker.sampling.metadata import SamplingMetadata
from pagedllm.worker.sampling.rows import filter_rows, row_values, take_rows

# top_p looks for its cut among this many most likely tokens before sorting a whole row.
_TOP_P_CANDIDATES = 1024


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first argmax and the fp32 logsumexp, in one C++ pass over the
    logits on CPU (PyTorch needs two, and a [rows, vocab] temporary)."""
    kernels = cpu_kernels_for(logits)
    if kernels is not None and logits.dtype in (torch.float32, torch.bfloat16):
        return kernels.argmax_logsumexp(logits)
    logits = logits.float()
    return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)


def sample(logits: torch.Tensor, metadata: SamplingMetadata, greedy_ids: torch.Tensor) -> torch.Tensor:
    """[num_rows] int64 token ids: ``greedy_ids`` (the argmax of ``logits``,
    overwritten here) for greedy rows, a seeded draw for the others."""
    params = metadata.params
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    token_ids = greedy_ids
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        token_ids[index] = _sample_random(
            take_rows(logits, random_rows),
            [params[i] for i in random_rows],
            [metadata.seeds[i] for i in random_rows],
            [metadata.output_positions[i] for i in random_rows],
        )
    return token_ids


def _sample_random(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, then the exponential race with per-row noise."""
    probs = target_probs(logits, params)
    noise = exponential_noise(seeds, positions, logits.shape[1], logits.device)
    return (probs / noise).argmax(dim=-1)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a random row draws from: softmax after temperature,
    top_k, top_p and min_p (speculative decoding verifies drafts against it)."""
    vocab = logits.shape[1]
    scaled = logits / row_values([p.temperature for p in params], logits)
    scaled = filter_rows(scaled, params, lambda p: 0 < p.top_k < vocab, _apply_top_k)
    scaled = filter_rows(scaled, params, lambda p: p.top_p < 1.0, _apply_top_p)
    scaled = filter_rows(scaled, params, lambda p: p.min_p > 0.0, _apply_min_p)
    return scaled.softmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep tokens whose logit is >= the row's k-th largest (ties with the k-th are kept)."""
    top_k = [p.top_k for p in params]
    kth = logits.topk(max(top_k), dim=-1).values.gather(1, row_values(top_k, logits) - 1)
    return logits.masked_fill(logits < kth, -math.inf)


def _apply_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p.

    The top token is always kept, and so are tokens tied with the least likely
    kept one. The cut nearly always falls within the most likely
    ``_TOP_P_CANDIDATES`` tokens, and a top-k of those is far cheaper than
    sorting the vocabulary, so only rows whose candidates fall short of top_p
    are fully sorted.
    """
    top_p = row_values([p.top_p for p in params], logits)
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
    # clamp: a top_p below float32's smallest value (5e-324 from JSON) rounds to 0, and the rule would keep nothing
    prefix_length = (cumulative - probs < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return sorted_logits.gather(1, prefix_length - 1), cumulative[:, -1] >= top_p[:, 0]


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability is < min_p * the top probability.

    Done in logit space, which saves a softmax:
    p_i < min_p * p_max  <=>  x_i < x_max + log(min_p).
    """
    log_min_p = row_values([math.log(p.min_p) for p in params], logits)
    threshold = logits.max(dim=-1, keepdim=True).values + log_min_p
    return logits.masked_fill(logits < threshold, -math.inf)


def exponential_noise(
    seeds: list[int], positions: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(seeds), vocab] Exp(1) noise; row i depends only on (seeds[i], positions[i]).
    The sampler draws ``argmax(probs / noise)`` (the exponential race), and
    speculative decoding reads its acceptance tests from the same noise."""
    noise = torch.empty(len(seeds), vocab, device=device)
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        generator = torch.Generator(device=device)
        generator.manual_seed(mix_seed(seed, position))
        noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would make a masked token's 0 / 0 a NaN, which argmax
    # would pick as the maximum.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
