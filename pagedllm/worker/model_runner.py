"""Turns a SchedulerOutput into tensors, runs the model over the paged pool, samples.

The runner owns the model and the KV pool tensors; it never decides anything
about blocks (that is ``core/``), it only follows the block tables it is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, PrefillSpan
from pagedllm.attention.selector import attention_backend_for
from pagedllm.core.grammar_bitmask import GrammarBitmask
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.kv_tiers.runner_tiers import RunnerTiers
from pagedllm.logger import init_logger
from pagedllm.lora.page_layout import page_elems_of
from pagedllm.model.base import CausalLM
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.kv_tiers.block_codec import BlockCodec
from pagedllm.kv_tiers.host import HostKVStore
from pagedllm.worker.block_mover import BlockMover
from pagedllm.worker.block_moves import allocate_caches, layer_caches
from pagedllm.worker.cuda_graphs import DecodeGraphs, why_no_graphs
from pagedllm.worker.input_batch import CachedSequence, InputBatch, StepArrays
from pagedllm.worker.lora_adapters import RunnerAdapters
from pagedllm.worker.mrope import MRopePositions
from pagedllm.worker.multimodal_embeds import image_groups, multimodal_embedder_for
from pagedllm.config.pooling import PoolerSpec
from pagedllm.worker.pooler import DecoderPooler
from pagedllm.worker.runner_spec import RunnerSpec
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.spec_decode.draft_model import DraftModel
from pagedllm.worker.spec_decode.speculator import Speculator
from pagedllm.worker.step_inputs import StepInputs
from pagedllm.worker.step_sampler import StepSampler
from pagedllm.worker.tail_slots import StepTokens, TailSlots

logger = init_logger(__name__)


def _speculator(spec: RunnerSpec, device: torch.device, config: SpeculativeConfig, eos_token_ids: list[int],
                draft_model: CausalLM | None) -> Speculator:
    """The driver's drafter and verifier; a ``draft_model`` keeps its own pool over the same block ids."""
    draft = None if draft_model is None else DraftModel(
        draft_model, spec.num_blocks, spec.block_size, spec.dtype, spec.kv_cache_dtype, device,
        spec.num_swap_blocks, config.num_speculative_tokens,
    )
    return Speculator(config, eos_token_ids, draft)


@dataclass
class _Batch:
    """The flattened inputs of one forward pass."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    order: list[ScheduledSequence]  # decodes first, then prefill spans
    last_rows: list[int]  # row of each scheduled sequence's last token, in `order`
    host_positions: np.ndarray  # positions and each group's slot_mapping ([group, token]) as host arrays
    host_slots: np.ndarray


def _why_eager(model: CausalLM, spec: RunnerSpec, device: torch.device, attention) -> str | None:
    """Why decode steps run without CUDA graphs (None: they are captured)."""
    if not spec.cuda_graphs:
        return "enforce_eager"
    reason = why_no_graphs(model, device, attention, spec.kv_groups.num_groups)
    if reason and device.type == "cuda":  # CPU users never asked for graphs
        logger.info("Decode steps run eagerly: %s", reason)
    return reason


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        spec: RunnerSpec,
        device: torch.device,
        *,
        eos_token_ids: Sequence[int] = (),
        broadcast_step: Callable[[StepInputs], None] | None = None,
        speculative_config: SpeculativeConfig | None = None,
        draft_model: CausalLM | None = None,
        pooler: PoolerSpec | None = None,
    ) -> None:
        """A runner of ``model`` over a pool of ``spec``'s shape on ``device``;
        every rank builds one from the same ``spec``. The rest is the driver's
        (rank 0, which samples): ``eos_token_ids`` for the sampler;
        ``broadcast_step``, on a tensor-parallel driver, sends each step's inputs to the other ranks
        before this rank runs it (they run the same forward, whose all-reduces need every rank); with ``speculative_config``
        it verifies and proposes drafts (``draft_model``: the loaded draft of a ``draft_model``
        config); with ``pooler`` it pools the pooling sequences (``worker/pooler.py``).
        ``spec.cuda_graphs`` captures decode steps where the device and model allow
        (``pagedllm.worker.cuda_graphs``); ``spec.tails`` (int8 pools) keeps
        still-filling blocks also in full precision (``pagedllm.worker.tail_slots``).
        ``spec.kv_groups``: ``kv_caches`` are its ``num_slots`` slot caches, what every block
        move works on; the model reads ``layer_caches``, one per layer, aliasing them (``block_moves``' safety rule)."""
        self.model = model
        self.broadcast_step = broadcast_step
        self.block_size = block_size = spec.block_size
        self.device = device
        self.attention = attention_backend_for(device, block_size, spec.kv_cache_dtype, tails=spec.tails,
                                               dtype=spec.dtype)
        self.kv_groups = groups = spec.kv_groups
        self.num_kv_groups = groups.num_groups
        no_graphs = _why_eager(model, spec, device, self.attention)
        # With graphs, one block past the scheduler's pool takes the padded rows' writes.
        num_blocks = spec.num_blocks + (not no_graphs)
        self.kv_caches = allocate_caches(model, num_blocks, block_size, spec.dtype, spec.kv_cache_dtype, device,
                                         spec.tails, groups.num_slots)
        self.layer_caches = layer_caches(self.kv_caches, groups)
        self.tail_slots = TailSlots(num_blocks, block_size) if spec.tails else None
        # Swapped blocks and (on the driver with tiers) the host tier's entries.
        self.host_store = HostKVStore(BlockCodec(self.kv_caches), spec.num_swap_blocks)
        self.mover = BlockMover(self.kv_caches, self.host_store)
        # Values of the model's dtype one LoRA page holds: the one place the page size is
        # read off the pool (the adapters' page-ins, the registry's admission and bench use it).
        self.adapter_page_elems = page_elems_of(self.kv_caches[0].key, spec.dtype)
        self.sampler = Sampler(list(eos_token_ids))
        self.speculator = None if speculative_config is None else _speculator(
            spec, device, speculative_config, list(eos_token_ids), draft_model)
        self.batch = InputBatch(spec.max_num_seqs, spec.max_model_len, block_size, groups.num_groups)
        # Sequence id -> what the sampler reads of it (prompt, outputs, params) and its batch row.
        self.sequences: dict[str, CachedSequence] = self.batch.sequences
        self.decode_graphs = None if no_graphs else self._capture_graphs(spec.max_num_seqs, spec.max_model_len,
                                                                          spec.num_blocks)
        self.step_sampler = StepSampler(model.compute_logits, self.sampler, self.speculator, self.batch, device)
        self.pooler = None if pooler is None else DecoderPooler(pooler, model.compute_logits, self.sequences)
        self.adapters = None if not spec.max_lora_rank else RunnerAdapters(
            model, model.config, self.layer_caches, spec.dtype, spec.max_lora_rank, device, self.adapter_page_elems)
        self.mover.adapters = self.adapters
        self.embedder = multimodal_embedder_for(model, spec.encoder_cache_bytes, device)  # images (None: text only)
        self.mrope = MRopePositions.for_model(model)  # [3, tokens] rotary positions (None: the indices)

    @torch.inference_mode()
    def _capture_graphs(self, max_num_seqs: int, max_model_len: int, pad_block: int) -> DecodeGraphs | None:
        graphs = DecodeGraphs(self.model, self.kv_caches, self.attention, max_num_seqs, max_model_len,
                              self.block_size, pad_block)
        try:
            graphs.capture()
        except RuntimeError as error:  # an op of this model that cannot be captured
            logger.warning("CUDA graph capture failed (%s); decode steps run eagerly "
                           "(enforce_eager skips the attempt)", error)
            return None
        return graphs

    def attach_tiers(self, tiers: RunnerTiers) -> None:
        """Carry out each step's tier moves with ``tiers`` (the driver of one rank only)."""
        self.mover.attach_tiers(tiers)

    def _update_sequences(self, scheduler_output: SchedulerOutput) -> None:
        """Forget released sequences, learn new ones, then apply the step's diffs
        (in that order: a sequence preempted and resumed in one step is relearnt)."""
        for sequence_id in scheduler_output.released_sequence_ids:
            self.batch.release(sequence_id)
        if self.speculator is not None:
            self.speculator.forget(scheduler_output.released_sequence_ids)
        for data in scheduler_output.new_sequences:
            sequence = self.batch.add(data)
            if self.mrope is not None:
                self.mrope.learn(sequence)
        self.batch.apply(scheduler_output.scheduled)

    def speculation_stats(self) -> dict[str, int | float]:
        """Drafts verified and accepted so far (vLLM's spec_decode counters); empty when off."""
        speculator = self.speculator
        if speculator is None:
            return {}
        return {
            "spec_num_draft_tokens": speculator.num_draft_tokens,
            "spec_num_accepted_tokens": speculator.num_accepted_tokens,
            "spec_acceptance_rate": speculator.num_accepted_tokens / max(1, speculator.num_draft_tokens),
        }

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Run one step. ``grammar`` masks the guided sample rows (structured
        output); only this rank samples, so tensor-parallel workers never see it."""
        started = time.perf_counter()
        output = ModelRunnerOutput()
        self._update_sequences(scheduler_output)
        batch = None if scheduler_output.is_empty else self._prepare(scheduler_output)
        step = StepInputs(scheduler_output.block_moves)
        if self.tail_slots is not None:
            tokens = None if batch is None else StepTokens(batch.host_positions, batch.host_slots, batch.metadata)
            tails = self.tail_slots.plan(scheduler_output, self.sequences, self.batch.block_table, tokens, self.device)
            if tails:  # the scheduler's plan stays as it was sent
                step.block_moves = step.block_moves.copy()
                step.block_moves.extend(tails)
        if batch is not None:
            step.input_ids, step.positions, step.metadata = batch.input_ids, batch.positions, batch.metadata
        if self.adapters is not None:
            step.adapter_runs = [] if batch is None else self._adapter_runs(batch)
        if self.embedder is not None and batch is not None:
            step.multimodal_embeds = self.embedder.step_embeds(batch.order, batch.last_rows, self.sequences)
        if self.broadcast_step is not None:
            self.broadcast_step(step)
        prepared = time.perf_counter()
        hidden = self.run_step(step)
        self.mover.after_forward(step.block_moves)
        if self.speculator is not None:
            self.speculator.observe(step)
        if batch is not None:
            forwarded = time.perf_counter()
            stage = self.step_sampler
            output.sampled, output.proposed_draft_token_ids = stage.sample(batch.order, batch.last_rows, hidden, grammar)
            output.prompt_logprobs = stage.prompt_logprobs(batch.order, batch.last_rows, hidden)
            if self.pooler is not None:
                output.pooled = self.pooler.pool(batch.order, batch.last_rows, hidden)
            output.timings = {
                "input preparation": prepared - started,
                "forward": forwarded - prepared,
                "sampling": time.perf_counter() - forwarded,
            }
        output.elapsed_s = time.perf_counter() - started
        if self.speculator is not None:
            self.speculator.record_step(scheduler_output.scheduled, output.elapsed_s)
        return output

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> torch.Tensor | None:
        """Carry out the plan's phases before the forward (block moves, then
        adapter page-ins), then run the forward: the part every rank runs. Returns the final hidden states
        (None when the step has no tokens). The driver runs the phases after
        the forward (``execute``)."""
        self.mover.before_forward(step.block_moves)
        if self.adapters is not None:
            self.adapters.set_step(step.adapter_runs, 0 if step.input_ids is None else step.input_ids.shape[0])
        if step.input_ids is None:
            return None
        if step.multimodal_embeds is not None or step.positions.dim() > 1:  # (a graph replays 1-D text steps only)
            return self.model(step.input_ids, step.positions, self.layer_caches, step.metadata, self.attention,
                              multimodal_embeds=step.multimodal_embeds)
        if self.decode_graphs is not None and self.decode_graphs.fits(step.input_ids.shape[0], step.metadata):
            return self.decode_graphs.run(step.input_ids, step.positions, step.metadata)
        return self.model(step.input_ids, step.positions, self.layer_caches, step.metadata, self.attention)

    def _prepare(self, scheduler_output: SchedulerOutput) -> _Batch:
        """Gather the step's inputs from the persistent batch. Decode rows come
        first and read the pool in one batched gather: single-token spans
        (decodes, one-token prompt tails) and the spans of draft tokens, one
        row per token with the context up to it (the pool holds the whole
        span's K/V before any row reads, so row j sees the drafts before it).
        Prefill chunks go through the prefill path. With more than one KV cache
        group, the metadata carries each group's view (``AttentionMetadata.for_cache``)."""
        def is_decode(s: ScheduledSequence) -> bool:
            return s.num_scheduled_tokens == 1 or bool(s.draft_token_ids)

        order = sorted(scheduler_output.scheduled, key=lambda s: not is_decode(s))
        spans = np.array(
            [(self.sequences[s.sequence_id].row, s.num_computed_tokens, s.num_scheduled_tokens) for s in order],
            dtype=np.int64,
        ).reshape(len(order), 3)
        rows, counts = spans[:, 0], spans[:, 2]
        arrays = self.batch.gather(rows, spans[:, 1], counts)
        num_decode_spans = sum(map(is_decode, order))
        num_decodes = int(counts[:num_decode_spans].sum())
        decode_context_lens = arrays.positions[:num_decodes] + 1
        width = -(-int(decode_context_lens.max(initial=0)) // self.block_size)
        decode_rows = np.repeat(rows[:num_decode_spans], counts[:num_decode_spans])
        # Each prefill span's images whose tokens attend both ways (Gemma 3; none for other models).
        groups = [image_groups(self.sequences[s.sequence_id].mm_features, self.sequences[s.sequence_id].prompt_token_ids,
                               s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens)
                  for s in order[num_decode_spans:]]
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(arrays.slot_mapping),
            num_decodes=num_decodes,
            decode_block_tables=self._tensor(self.batch.decode_tables(decode_rows, width)),
            decode_context_lens=self._tensor(decode_context_lens),
            prefills=self._prefill_spans(arrays, rows, counts, num_decode_spans, groups),
        )
        if self.num_kv_groups > 1:
            metadata.group_views = [metadata] + [
                replace(metadata, slot_mapping=self._tensor(arrays.slot_mappings[group]),
                        decode_block_tables=self._tensor(self.batch.decode_tables(decode_rows, width, group)),
                        prefills=self._prefill_spans(arrays, rows, counts, num_decode_spans, groups, group))
                for group in range(1, self.num_kv_groups)
            ]
        return _Batch(
            input_ids=self._tensor(arrays.input_ids),
            positions=self._tensor(arrays.positions if self.mrope is None
                                   else self.mrope.step_positions(order, self.sequences, arrays.positions)),
            metadata=metadata,
            order=order,
            last_rows=arrays.last_rows.tolist(),
            host_positions=arrays.positions,
            host_slots=arrays.slot_mappings,
        )

    def _prefill_spans(self, arrays: StepArrays, rows: np.ndarray, counts: np.ndarray, first: int,
                       image_runs: list[tuple[tuple[int, int], ...]], group: int = 0) -> list[PrefillSpan]:
        """Spans ``first..`` of the step (the prefill chunks), reading ``group``'s tables;
        ``image_runs``: each one's ``PrefillSpan.image_groups``."""
        return [
            PrefillSpan(
                query_start=int(arrays.last_rows[i] - counts[i] + 1),
                query_len=int(counts[i]),
                context_len=int(arrays.context_lens[i]),
                block_table=self._tensor(self.batch.block_table[group, rows[i], : arrays.num_blocks[i]].copy()),
                image_groups=image_runs[i - first],
            )
            for i in range(first, len(rows))
        ]

    def _adapter_runs(self, batch: _Batch) -> list[tuple[int, int, str | None]]:
        """Each scheduled sequence's rows and its adapter, in row order."""
        return [(last - s.num_scheduled_tokens + 1, last + 1, self.sequences[s.sequence_id].lora_name)
                for s, last in zip(batch.order, batch.last_rows)]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A step's int64 array on the device (shared, not copied, on the CPU:
        callers hand over arrays no later step writes)."""
        return torch.from_numpy(array).to(self.device)
