"""EncoderPoolingRunner: encoder-only checkpoints run for embed / classify / score / encode.

Inputs are sorted by length and cut into packed batches of at most
``max_num_batched_tokens`` tokens; each batch is one forward pass with no padding
(``model.bert.PackedBatch``). Encoder models hold no KV cache, so they take no blocks
from the pool: the runner sits beside the engine, not inside it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers.normalizers import Lowercase
from tokenizers.normalizers import Sequence as NormalizerSequence
from transformers import AutoTokenizer

from pagedllm.model.bert import PackedBatch
from pagedllm.model.encoders import EncoderModel, encoder_architecture, load_encoder
from pagedllm.pooling.poolers import Dense, activation_module, pool
from pagedllm.pooling.st_folder import STFolder, prompt_token_count, read_st_folder
from pagedllm.pooling_params import PoolingParams


@dataclass(frozen=True)
class PoolingInput:
    token_ids: list[int]
    params: PoolingParams                     # params.task is set (never None here)
    token_type_ids: list[int] | None = None   # BERT segment ids of a text pair (cross-encoders)
    # How many leading tokens are the instruction prompt ([CLS] included, as sentence-transformers
    # counts them; see ``EncoderPoolingRunner.prompt_token_count``): pooling leaves them out
    # when the folder's Pooling config says include_prompt: false.
    num_prompt_tokens: int = 0


def _model_folder(folder: Path) -> Path:
    """Where config.json is: the folder, or its sentence-transformers Transformer module's path."""
    modules_file = folder / "modules.json"
    if (folder / "config.json").is_file() or not modules_file.is_file():
        return folder
    for module in json.loads(modules_file.read_text()):
        if module.get("type", "").endswith(".Transformer"):
            return folder / module.get("path", "")
    return folder


def is_encoder_checkpoint(folder: Path) -> bool:
    """Whether the folder's config.json names an encoder architecture this runner runs."""
    return encoder_architecture(_model_folder(Path(folder))) is not None


def _lowercase(tokenizer) -> None:
    """do_lower_case, as sentence-transformers applies it: a Lowercase normalizer in front."""
    normalizer = tokenizer.backend_tokenizer.normalizer
    parts = list(normalizer) if isinstance(normalizer, NormalizerSequence) else [normalizer] if normalizer else []
    if not any(isinstance(part, Lowercase) for part in parts):
        tokenizer.backend_tokenizer.normalizer = NormalizerSequence([Lowercase(), *parts])


class EncoderPoolingRunner:
    def __init__(self, model: EncoderModel, st: STFolder, tokenizer, dtype: torch.dtype,
                 max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}")
        self.model, self.st, self.tokenizer = model, st, tokenizer
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len: int = min(st.max_seq_length or model.encoder.max_len, model.encoder.max_len)
        self.prompts: dict[str, str] = dict(st.prompts)
        self.default_prompt_name: str | None = st.default_prompt_name
        self.dense = [Dense(config, dtype) for config in st.dense]
        self.num_labels = model.config.num_labels if model.head is not None else 0
        self.supported_tasks: tuple[str, ...] = (
            ("embed", "encode") if model.head is None
            # A pair score is one number: a one-label head's (as sentence-transformers' CrossEncoder).
            else ("classify", "score", "encode") if self.num_labels == 1 else ("classify", "encode"))
        st_settings = getattr(model.config, "sentence_transformers", None) or {}
        # A CrossEncoder saved by sentence-transformers may name its activation; else sigmoid
        # (also for a non-torch one, which sentence-transformers runs only with trust_remote_code).
        activation = st_settings.get("activation_fn", "")
        self.score_activation = activation_module(activation if activation.startswith("torch.") else "torch.nn.Sigmoid")

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype = torch.float32,
                    max_num_batched_tokens: int = 8192) -> EncoderPoolingRunner:
        folder = Path(folder)
        model_folder = _model_folder(folder)
        architecture = encoder_architecture(model_folder)
        classifier = architecture is not None and "ForSequence" in architecture
        st = read_st_folder(folder, classifier=classifier)
        if classifier:
            st = replace(st, model_folder=model_folder)
        model = load_encoder(st.model_folder, dtype)
        tokenizer = AutoTokenizer.from_pretrained(st.model_folder, local_files_only=True)
        if st.do_lower_case:
            _lowercase(tokenizer)
        return cls(model, st, tokenizer, dtype, max_num_batched_tokens)

    def prompt_token_count(self, prompt: str) -> int:
        """The prompt's token count as sentence-transformers measures it for include_prompt."""
        return prompt_token_count(self.tokenizer, prompt)

    def _check(self, index: int, item: PoolingInput) -> None:
        what = f"input {index}"
        task = item.params.task
        if task not in self.supported_tasks:
            raise ValueError(f"{what}: task {task!r} is not supported by this model; it supports "
                             f"{', '.join(self.supported_tasks)}")
        if not item.token_ids:
            raise ValueError(f"{what} is empty: give at least one token")
        if len(item.token_ids) > self.max_model_len:
            raise ValueError(f"{what} has {len(item.token_ids)} tokens, over the model's limit of "
                             f"{self.max_model_len}: shorten it or set truncate_prompt_tokens")
        if item.token_type_ids is not None and len(item.token_type_ids) != len(item.token_ids):
            raise ValueError(f"{what}: token_type_ids has {len(item.token_type_ids)} entries for "
                             f"{len(item.token_ids)} tokens; give one per token")
        types = self.model.encoder.num_token_types
        if types is not None and item.token_type_ids is not None \
                and not all(0 <= t < types for t in item.token_type_ids):
            raise ValueError(f"{what}: token_type_ids must be in 0..{types - 1} for this model")
        if not 0 <= item.num_prompt_tokens <= len(item.token_ids):
            raise ValueError(f"{what}: num_prompt_tokens {item.num_prompt_tokens} is outside 0..{len(item.token_ids)}")
        width = self.embedding_size()
        if task == "embed" and item.params.dimensions is not None and item.params.dimensions > width:
            raise ValueError(f"{what}: dimensions {item.params.dimensions} is over the embedding size {width}")

    def embedding_size(self) -> int:
        """The width of an embedding before ``dimensions`` cuts it."""
        if self.dense:
            return self.dense[-1].weight.shape[0]
        return self.model.encoder.hidden_size * len(self.st.pooling.modes)

    def _batches(self, inputs: Sequence[PoolingInput]) -> list[list[int]]:
        """Input indices, longest first, cut into runs of at most max_num_batched_tokens tokens
        (an input over the budget alone runs alone)."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].token_ids), reverse=True)
        batches: list[list[int]] = []
        used = self.max_num_batched_tokens
        for index in order:
            size = len(inputs[index].token_ids)
            if used + size > self.max_num_batched_tokens:
                batches.append([])
                used = 0
            batches[-1].append(index)
            used += size
        return batches

    def run(self, inputs: Sequence[PoolingInput]) -> list[torch.Tensor]:
        """One float32 CPU tensor per input, in order: ``embed`` ``[D]`` (pooled, Dense layers,
        normalized per ``params.normalize`` or the folder's Normalize, cut to ``params.dimensions``);
        ``classify`` ``[num_labels]`` probabilities; ``score`` ``[1]``; ``encode`` ``[T, H]``.
        Every input is checked first: a bad one is a ValueError and nothing runs."""
        for index, item in enumerate(inputs):
            self._check(index, item)
        results: list[torch.Tensor | None] = [None] * len(inputs)
        with torch.inference_mode():
            for indices in self._batches(inputs):
                items = [inputs[i] for i in indices]
                batch = PackedBatch.build([item.token_ids for item in items], [item.token_type_ids for item in items])
                hidden = self.model.encoder.forward(batch)
                for index, output in zip(indices, self._outputs(items, batch, hidden)):
                    results[index] = output.float().cpu()
        return [result for result in results if result is not None]  # every slot is filled above

    def _outputs(self, items: list[PoolingInput], batch: PackedBatch, hidden: torch.Tensor) -> list[torch.Tensor]:
        tasks = {item.params.task for item in items}
        # Each is computed for the whole batch only when some input asks for it.
        embeddings = hidden.new_empty(0)
        if "embed" in tasks:
            embeddings = pool(hidden, batch, [item.num_prompt_tokens for item in items], self.st.pooling)
            for dense in self.dense:
                embeddings = dense(embeddings)
        logits = hidden.new_empty(0)
        if self.model.head is not None and tasks & {"classify", "score"}:
            logits = self.model.head.logits(hidden, batch)
        tokens = hidden.split(list(batch.seq_lens))
        outputs = []
        for row, item in enumerate(items):
            if item.params.task == "encode":
                outputs.append(tokens[row].clone())  # a copy: a view would keep the whole batch alive
            elif item.params.task == "embed":
                outputs.append(self._embedding(embeddings[row], item.params))
            else:
                outputs.append(self._activated(logits[row], item.params))
        return outputs

    def _activated(self, logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """classify: softmax over the labels (sigmoid for one); score: the cross-encoder's activation."""
        if params.use_activation is False:
            return logits
        if params.task == "score":
            return self.score_activation(logits)
        return torch.sigmoid(logits) if self.num_labels == 1 else torch.softmax(logits, dim=-1)

    def _embedding(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.st.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, p=2, dim=-1) if normalize else vector
