"""A step's image embeddings: which rows of the forward get which encoder output rows.

A prefill chunk may start or stop inside an image's placeholder run (chunked
prefill and prefix-cache hits split images anywhere): the image's whole encoder
output comes from the encoder cache (or the encoder, once) and the chunk takes
the rows of its own placeholder positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.worker.encoder_cache import EncoderCache


class MultimodalEmbedder:
    """Runs ``embed_image`` (the model's) through ``cache`` for the images a step's spans cover."""

    def __init__(self, embed_image: Callable[[object], torch.Tensor], cache: EncoderCache,
                 device: torch.device) -> None:
        self.embed_image = embed_image
        self.cache = cache
        self.device = device

    def step_embeds(self, order: Sequence[ScheduledSequence], last_rows: Sequence[int],
                    sequences: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(forward rows, their embeddings) for every image position scheduled this step; None without any."""
        rows: list[np.ndarray] = []
        chunks: list[torch.Tensor] = []
        for scheduled, last_row in zip(order, last_rows):
            sequence = sequences[scheduled.sequence_id]
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_scheduled_tokens
            for feature in sequence.mm_features:
                if feature.placeholder.offset < end and start < feature.placeholder.end:
                    positions = self._embed_positions(feature, sequence.prompt_token_ids)
                    wanted = np.flatnonzero((positions >= start) & (positions < end))
                    if len(wanted):
                        rows.append(last_row - (end - 1) + positions[wanted])
                        chunks.append(self._embeds(feature)[torch.from_numpy(wanted).to(self.device)])
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(rows)).to(self.device), torch.cat(chunks)

    @staticmethod
    def _embed_positions(feature: MultiModalFeature, prompt: list[int]) -> np.ndarray:
        """Prompt positions of the image's rows: its placeholder tokens, in order."""
        span = np.asarray(prompt[feature.placeholder.offset:feature.placeholder.end])
        return feature.placeholder.offset + np.flatnonzero(span == feature.embed_token_id)

    def _embeds(self, feature: MultiModalFeature) -> torch.Tensor:
        embeds = self.cache.get_or_compute(feature.identifier, lambda: self.embed_image(feature.data))
        if embeds.shape[0] != feature.num_embeds:
            raise ValueError(f"the image encoder gave {embeds.shape[0]} rows for an image with "
                             f"{feature.num_embeds} placeholder tokens; the processor and the model disagree")
        return embeds


def image_groups(features: Sequence[MultiModalFeature], prompt: list[int], start: int,
                 end: int) -> tuple[tuple[int, int], ...]:
    """[first, last + 1) of each run of consecutive image tokens of the images the model attends
    both ways (``MultiModalFeature.attends_both_ways``) whose placeholder overlaps [start, end)."""
    runs: list[tuple[int, int]] = []
    for feature in features:
        if feature.attends_both_ways and feature.placeholder.offset < end and start < feature.placeholder.end:
            positions = MultimodalEmbedder._embed_positions(feature, prompt)
            for run in np.split(positions, np.flatnonzero(np.diff(positions) > 1) + 1):
                runs.append((int(run[0]), int(run[-1]) + 1))
    return tuple(runs)


def multimodal_embedder_for(model: object, encoder_cache_bytes: int, device: torch.device) -> MultimodalEmbedder | None:
    """A vision-language model's (one with ``embed_image``) embedder over a fresh encoder
    cache; None for a text-only model. Only the driver runs it: the step carries its rows."""
    embed_image = getattr(model, "embed_image", None)
    return None if embed_image is None else MultimodalEmbedder(embed_image, EncoderCache(encoder_cache_bytes), device)
