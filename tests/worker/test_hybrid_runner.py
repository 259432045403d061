"""The model runner over a hybrid KV layout (``core.kv_groups``): slot caches
shared by the layers of different groups, one block table per group. Driven by
hand-built scheduler outputs whose groups take different physical blocks and
whose sliding groups give back the entries behind their window (the null
block), it generates what Hugging Face's model does, and what the runner with
one group of every layer does."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma3TextConfig

from pagedllm.core.block_moves import BlockMovePlan, CopyBlock, SwapIn, SwapOut
from pagedllm.core.kv_groups import KVGroupLayout, kv_group_layout
from pagedllm.core.kv_interface import NULL_BLOCK_ID
from pagedllm.core.scheduler_output import NewSequenceData, SampleRow, ScheduledSequence, SchedulerOutput
from pagedllm.model.gemma import GemmaForCausalLM
from pagedllm.model.shapes import sliding_windows_of
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.runner_spec import RunnerSpec
from tests.model.test_gemma import tiny_gemma

BLOCK_SIZE = 4
NUM_BLOCKS = 96
VOCAB = 96
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gemma3():
    """A tiny random Gemma 3 of 12 layers (window 8, 5 local : 1 global): two full layers
    and ten sliding ones, so six groups of two layers and a block of two slots."""
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                              initializer_range=0.05, num_hidden_layers=12, sliding_window=8,
                              query_pre_attn_scalar=24)
    return tiny_gemma(config)


def runner_for(hf_model, layout: KVGroupLayout, num_swap_blocks: int = 0) -> ModelRunner:
    model = GemmaForCausalLM(hf_model.config)
    model.load_weights({name: tensor.clone() for name, tensor in hf_model.state_dict().items()})
    spec = RunnerSpec(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_swap_blocks=num_swap_blocks, dtype=torch.float32,
                      kv_cache_dtype="auto", tails=False, max_num_seqs=2, max_model_len=64, cuda_graphs=False,
                      kv_groups=layout)
    return ModelRunner(model.eval(), spec, CPU)


class HandScheduler:
    """Per-group tables as the coordinator keeps them: every group takes its own blocks
    from one shuffled free list (block ids, 0 included, go to any group and come back
    to the list when released), and a sliding group gives back each entry once no
    query of the next span can see it, leaving ``NULL_BLOCK_ID`` in its place."""

    def __init__(self, layout: KVGroupLayout, seed: int) -> None:
        self.windows = layout.windows
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[list[int]]] = {}

    def grow(self, sid: str, end: int) -> list[list[int]]:
        """Each group's new entries for a context of ``end`` tokens."""
        tables = self.tables.setdefault(sid, [[] for _ in self.windows])
        added = [[self.free.pop() for _ in range(cdiv(end, BLOCK_SIZE) - len(table))] for table in tables]
        for table, more in zip(tables, added):
            table.extend(more)
        return added if added[0] else []

    def release_behind(self, sid: str, first: int) -> list[tuple[int, int, int]]:
        """(group, index, NULL_BLOCK_ID) of the entries no query from position ``first`` on reads."""
        released = []
        for group, (window, table) in enumerate(zip(self.windows, self.tables[sid])):
            if window is None:
                continue
            for index in range(max(0, first - window + 1) // BLOCK_SIZE):
                if table[index] != NULL_BLOCK_ID:
                    self.free.append(table[index])
                    table[index] = NULL_BLOCK_ID
                    released.append((group, index, NULL_BLOCK_ID))
        return released

    def hit(self, sid: str, cached: str, num_tokens: int) -> None:
        """``sid`` takes the first ``num_tokens`` tokens' blocks of ``cached`` (a prefix
        hit of whole blocks), each group its own: a sliding group only those inside the
        window of the first token computed, its earlier entries null; ``cached`` is gone."""
        tables = self.tables.pop(cached)
        num_blocks = num_tokens // BLOCK_SIZE
        self.tables[sid] = []
        for window, table in zip(self.windows, tables):
            outside = 0 if window is None else max(0, num_tokens - window + 1) // BLOCK_SIZE
            kept = [NULL_BLOCK_ID] * outside + table[outside:num_blocks]
            self.free += [block for block in table[:outside] + table[num_blocks:] if block != NULL_BLOCK_ID]
            self.tables[sid].append(kept)


def generate(runner: ModelRunner, layout: KVGroupLayout, prompts: dict[str, list[int]], chunk: int,
             max_tokens: int, seed: int = 0, scheduler: HandScheduler | None = None,
             computed: dict[str, int] | None = None,
             released: list[str] = ()) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs of every prompt, run together: prompts in
    chunks of ``chunk`` tokens, then one token a step. ``computed``: tokens of a prompt
    already in the pool (a prefix hit ``scheduler`` holds); ``released``: sequences
    the first step releases."""
    scheduler = scheduler or HandScheduler(layout, seed)
    computed = {sid: 0 for sid in prompts} | (computed or {})
    outputs: dict[str, tuple[list[int], list[float]]] = {sid: ([], []) for sid in prompts}
    unseen: dict[str, list[int]] = {sid: [] for sid in prompts}  # tokens the runner has not been sent
    sent: set[str] = set()
    params = SamplingParams(temperature=0.0)
    while any(len(tokens) < max_tokens for tokens, _ in outputs.values()):
        step = SchedulerOutput(released_sequence_ids=[] if sent else list(released))
        for sid, prompt in prompts.items():
            tokens = outputs[sid][0]
            if len(tokens) == max_tokens:
                continue
            known = len(prompt) + len(tokens)
            start = computed[sid]
            count = min(chunk, known - start)
            samples = [SampleRow(sid, 0, len(tokens))] if start + count == known else []
            if sid not in sent:
                scheduler.grow(sid, start + count)
                step.new_sequences.append(NewSequenceData(sid, prompt, [], [list(t) for t in scheduler.tables[sid]],
                                                          params))
                step.scheduled.append(ScheduledSequence(sid, start, count, sample_rows=samples))
                sent.add(sid)
            else:
                replaced = scheduler.release_behind(sid, start)
                step.scheduled.append(ScheduledSequence(
                    sid, start, count, new_token_ids=unseen[sid], new_block_ids=scheduler.grow(sid, start + count),
                    replaced_blocks=replaced, sample_rows=samples))
            unseen[sid] = []
            computed[sid] = start + count
        result = runner.execute(step)
        for sid, sampled in result.sampled.items():
            outputs[sid][0].extend(sampled.token_ids)
            outputs[sid][1].extend(sampled.logprobs)
            unseen[sid] = list(sampled.token_ids)
    return outputs


PROMPTS = {"a": [(37 * j + 11) % VOCAB for j in range(19)], "b": [(13 * j + 5) % VOCAB for j in range(30)]}


def test_the_gemma3_layout_is_hybrid(gemma3):
    layout = kv_group_layout(sliding_windows_of(gemma3.config))
    assert (layout.num_groups, layout.num_slots) == (6, 2)
    assert layout.groups[0].layers == (5, 11) and layout.windows == (None, 8, 8, 8, 8, 8)


def test_hybrid_runner_generates_what_hugging_face_and_one_group_do(gemma3):
    """Two prompts (one prefilled in chunks past its window) decode 14 tokens each, so
    every sliding group releases most of its entries; the tokens are HF's greedy ones
    with its logprobs, and the one-group runner's bit for bit."""
    windows = sliding_windows_of(gemma3.config)
    hybrid_layout, one_layout = kv_group_layout(windows), kv_group_layout(windows, hybrid=False)
    hybrid = runner_for(gemma3, hybrid_layout)
    assert len(hybrid.kv_caches) == 2 and len(hybrid.layer_caches) == 12
    # Layer l reads slot slot_of_layer[l]'s tensors through its group's tables.
    for layer, cache in enumerate(hybrid.layer_caches):
        assert cache.key is hybrid.kv_caches[hybrid_layout.slot_of_layer[layer]].key
        assert cache.group == hybrid_layout.group_of_layer[layer]
    ours = generate(hybrid, hybrid_layout, PROMPTS, chunk=12, max_tokens=14)
    one_group = generate(runner_for(gemma3, one_layout), one_layout, PROMPTS, chunk=12, max_tokens=14)
    for sid, prompt in PROMPTS.items():
        tokens, logprobs = ours[sid]
        assert tokens == one_group[sid][0]
        with torch.inference_mode():
            logits = gemma3(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
        assert tokens == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


def test_one_group_metadata_has_no_views(gemma3):
    """A one-group runner takes today's path: its layers read the step's metadata itself."""
    layout = kv_group_layout(sliding_windows_of(gemma3.config), hybrid=False)
    runner = runner_for(gemma3, layout)
    assert runner.layer_caches is runner.kv_caches and len(runner.kv_caches) == 12
    prompt = PROMPTS["a"]
    step = SchedulerOutput(scheduled=[ScheduledSequence("a", 0, len(prompt))],
                           new_sequences=[NewSequenceData("a", prompt, [], [list(range(1, 6))], SamplingParams())])
    runner._update_sequences(step)
    metadata = runner._prepare(step).metadata
    assert metadata.group_views is None and metadata.for_cache(runner.layer_caches[3]) is metadata


def test_block_moves_move_every_slot_cache_once(gemma3):
    """Copies and swaps name physical blocks: each moves row b of every slot cache, and
    the host swap pool mirrors the slot caches, not the layers that alias them."""
    layout = kv_group_layout(sliding_windows_of(gemma3.config))
    runner = runner_for(gemma3, layout, num_swap_blocks=4)
    assert len(runner.host_store.codec.slabs) == layout.num_slots * len(runner.kv_caches[0].tensors())
    torch.manual_seed(0)
    for cache in runner.kv_caches:
        for tensor in cache.tensors():
            tensor.normal_()
    before = [[tensor.clone() for tensor in cache.tensors()] for cache in runner.kv_caches]
    # Block 3 goes out to host block 1 and comes back as block 9; block 5 is copied to 7.
    runner.execute(SchedulerOutput(block_moves=BlockMovePlan([SwapOut(3, 1), CopyBlock(5, 7), SwapIn(1, 9)])))
    for cache, tensors in zip(runner.kv_caches, before):
        for tensor, old in zip(cache.tensors(), tensors):
            assert torch.equal(tensor[9], old[3]) and torch.equal(tensor[7], old[5])
            untouched = [b for b in range(NUM_BLOCKS) if b not in (7, 9)]
            assert torch.equal(tensor[untouched], old[untouched])


def test_a_prefix_hit_with_null_entries_behind_the_window(gemma3):
    """A sequence admitted on another's cached prefix of 28 tokens: the full group's table
    is the prefix's blocks, each sliding group's holds only the blocks inside the window of
    token 28 (null before); computing from token 28 on gives HF's greedy tokens."""
    layout = kv_group_layout(sliding_windows_of(gemma3.config))
    runner = runner_for(gemma3, layout)
    scheduler = HandScheduler(layout, seed=1)
    prefix = PROMPTS["b"]
    generate(runner, layout, {"a": prefix}, chunk=32, max_tokens=1, scheduler=scheduler)
    scheduler.hit("b", "a", 28)
    assert [table.count(NULL_BLOCK_ID) for table in scheduler.tables["b"]][1:] == [5] * 5
    prompt = prefix + [(7 * j + 3) % VOCAB for j in range(9)]
    tokens, logprobs = generate(runner, layout, {"b": prompt}, chunk=32, max_tokens=8, scheduler=scheduler,
                                computed={"b": 28}, released=["a"])["b"]
    with torch.inference_mode():
        logits = gemma3(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
