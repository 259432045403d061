"""Per-layer attention options: a sliding window, an attention chunk (Llama 4), logit
soft-capping and attention sinks (gpt-oss) must equal dense attention with Hugging Face's
mask, cap and sinks, on every backend, for fresh prefills, later prefill chunks that read the
pool, and decodes."""

import random

import pytest
import torch

from pagedllm.attention.backend import AttentionMetadata, PrefillSpan
from pagedllm.attention.kv_cache import LayerKVCache
from pagedllm.attention.selector import cpu_decode
from tests.attention.test_torch_paged import (
    HEAD_DIM, KERNEL, NUM_HEADS, NUM_KV_HEADS, SCALE, backend, decode_only_metadata, prefill_step, random_tables, slots_of,
)

__all__ = ["backend"]  # the fixture, imported for its parametrisation over backends

OPTIONS = [
    {"sliding_window": 5},
    {"sliding_window": 40},
    {"logits_soft_cap": 2.0},
    {"sliding_window": 7, "logits_soft_cap": 1.5},
    {"attention_chunk": 8},  # a chunk per two blocks of 4, and chunk starts mid-block at 16
    {"attention_chunk": 20, "logits_soft_cap": 1.5},
    # gpt-oss: a sink logit per head (some above the scores, some far below), on full and sliding layers.
    {"sinks": torch.linspace(-4.0, 3.0, NUM_HEADS)},
    {"sliding_window": 6, "sinks": torch.linspace(2.0, -1.0, NUM_HEADS)},
]


def _option_id(options: dict) -> str:
    return "-".join(k if isinstance(v, torch.Tensor) else f"{k}={v}" for k, v in options.items())


def dense_reference(q, k, v, sliding_window=None, logits_soft_cap=None, attention_chunk=None, sinks=None):
    """Hugging Face's eager attention of one whole sequence (q [L, H, D], k/v [L, Hkv, D]) in float64;
    ``sinks``: gpt-oss's, a per-head logit appended to the scores, its probability dropped."""
    group = NUM_HEADS // NUM_KV_HEADS
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) * SCALE
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    positions = torch.arange(q.shape[1])
    visible = positions[None, :] <= positions[:, None]
    if sliding_window is not None:
        visible &= positions[None, :] > positions[:, None] - sliding_window
    if attention_chunk is not None:  # Hugging Face's chunked_overlay: the same chunk only
        visible &= positions[None, :] // attention_chunk == positions[:, None] // attention_chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(0, 1).float()


@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_options_match_dense_attention(backend, options, block_size):
    torch.manual_seed(block_size)
    lens, chunk = [61, 23], 29
    tables, num_blocks = random_tables(lens, block_size, random.Random(block_size))
    # NaN where nothing is written: the pool is uninitialised, and no read may touch those slots.
    cache = LayerKVCache(torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan")),
                         torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan")))
    seqs = [(torch.randn(n, NUM_HEADS, HEAD_DIM), torch.randn(n, NUM_KV_HEADS, HEAD_DIM),
             torch.randn(n, NUM_KV_HEADS, HEAD_DIM)) for n in lens]
    expected = [dense_reference(*seq, **options) for seq in seqs]

    def prefill(parts):
        return prefill_step(backend, cache, tables, seqs, parts, block_size, SCALE, **options)

    # Step 1: a fresh chunk of each prompt; step 2: the rest of sequence 0's prompt reads step 1's from the pool.
    out = prefill([(0, 0, chunk), (1, 0, lens[1] - 1)])
    torch.testing.assert_close(out[:chunk], expected[0][:chunk], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[chunk:], expected[1][: lens[1] - 1], atol=1e-5, rtol=1e-5)
    out = prefill([(0, chunk, lens[0] - 1)])
    torch.testing.assert_close(out, expected[0][chunk: lens[0] - 1], atol=1e-5, rtol=1e-5)

    # Step 3: both decode their last token through the block tables.
    last = [n - 1 for n in lens]
    meta = decode_only_metadata(tables, lens)
    meta.slot_mapping = torch.tensor([slots_of(t, [p], block_size)[0] for t, p in zip(tables, last)])
    q, k, v = (torch.stack([seq[j][p] for seq, p in zip(seqs, last)]) for j in range(3))
    out = backend.forward(q, k, v, cache, meta, SCALE, **options)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], expected[i][-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("option, window, block_size", [
    ("sliding_window", 5, 4), ("sliding_window", 12, 8), ("sliding_window", 16, 16),
    ("attention_chunk", 6, 4), ("attention_chunk", 16, 8)])
def test_windowed_reads_never_touch_released_entries(backend, option, window, block_size):
    """Table entries wholly before the window or chunk (released by the KV manager)
    point at a block of NaNs (as is every slot never written): any read of one, even
    masked, would poison the output."""
    options = {option: window}
    torch.manual_seed(window)
    lens = [61, 23, 3]
    tables, num_blocks = random_tables(lens, block_size, random.Random(window))
    poison = num_blocks  # one extra block, all NaN
    cache = LayerKVCache(torch.full((num_blocks + 1, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan")),
                         torch.full((num_blocks + 1, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan")))
    seqs = [(torch.randn(n, NUM_HEADS, HEAD_DIM), torch.randn(n, NUM_KV_HEADS, HEAD_DIM),
             torch.randn(n, NUM_KV_HEADS, HEAD_DIM)) for n in lens]
    for table, (_, k, v), n in zip(tables, seqs, lens):
        slots = torch.tensor(slots_of(table, range(n), block_size))
        cache.key.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k
        cache.value.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v
    expected = [dense_reference(*seq, **options) for seq in seqs]

    def released(table, first_query):
        """The table with every entry before the window or chunk of ``first_query`` poisoned."""
        first_read = first_query // window * window if option == "attention_chunk" else first_query - window + 1
        first_block = max(0, first_read) // block_size
        return [poison] * first_block + table[first_block:]

    # Decodes of each sequence's last token (written again where it already is).
    meta = decode_only_metadata([released(t, n - 1) for t, n in zip(tables, lens)], lens)
    meta.slot_mapping = torch.tensor([slots_of(t, [n - 1], block_size)[0] for t, n in zip(tables, lens)])
    q, k, v = (torch.stack([seq[j][-1] for seq in seqs]) for j in range(3))
    out = backend.forward(q, k, v, cache, meta, SCALE, **options)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i], expected[i][-1], atol=1e-5, rtol=1e-5)
    # A later prefill chunk of sequence 0 (positions 40-60) gathers from the pool.
    first, n = 40, lens[0]
    span = PrefillSpan(0, n - first, n, torch.tensor(released(tables[0], first)))
    meta = AttentionMetadata(torch.tensor(slots_of(tables[0], range(first, n), block_size)), 0,
                             torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [span])
    q, k, v = (t[first:] for t in seqs[0])
    out = backend.forward(q, k, v, cache, meta, SCALE, **options)
    torch.testing.assert_close(out, expected[0][first:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpp_decode_kernel_reads_sinks(dtype, threads):
    """The C++ kernel's sinks, against the float64 reference, both where a sequence is one task
    (two sequences on one thread) and where its blocks are split across tasks and combined
    (one sequence): sinks above every score, far below, and one in a sliding window."""
    if KERNEL is None:
        pytest.fail("the C++ decode kernel did not build on this machine")
    torch.manual_seed(threads)
    lens, block_size = [45, 9], 4
    tables, num_blocks = random_tables(lens, block_size, random.Random(threads))
    cache = LayerKVCache(torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype),
                         torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype))
    seqs = [tuple(torch.randn(n, heads, HEAD_DIM).to(dtype) for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
            for n in lens]
    for table, (_, k, v), n in zip(tables, seqs, lens):
        slots = torch.tensor(slots_of(table, range(n), block_size))
        cache.key.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k
        cache.value.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window, sinks in ((None, torch.linspace(-30.0, 8.0, NUM_HEADS)), (6, torch.linspace(2.0, -1.0, NUM_HEADS))):
            batch = range(len(lens)) if threads == 1 else range(1)
            meta = decode_only_metadata([tables[i] for i in batch], [lens[i] for i in batch])
            q = torch.stack([seqs[i][0][-1] for i in batch])
            out = cpu_decode(q, cache, meta.decode_block_tables, meta.decode_context_lens, SCALE, window,
                             tail_slots=None, sinks=sinks.to(dtype))
            for i in batch:
                expected = dense_reference(*(t.float() for t in seqs[i]), sliding_window=window,
                                           sinks=sinks.to(dtype))[-1]
                torch.testing.assert_close(out[i].float(), expected, atol=tolerance, rtol=tolerance)
    finally:
        torch.set_num_threads(before)
