"""``LLM``'s pooling methods (vLLM's ``embed``, ``classify``, ``score``, ``encode``).

One code path builds every pooling input (``pooling_inputs.py``: tokenization,
truncation, text pairs; the server's pooling routes use it too) and hands it to a ``PoolingBackend``: the engine for a decoder (its requests go
through the pool and the prefix cache) or the encoder runner for an encoder
checkpoint (``pagedllm/pooling/encoder_runner.py``, imported only for one).

Scoring with a yes/no decoder reranker renders each pair with Qwen3-Reranker's
template, query first, so the documents of one call share the query's prefix
blocks (their ``num_cached_tokens`` show it); another model scores the pair as
its tokenizer joins two texts (``tokenizer(text_1, text_2)``, with BERT's
``token_type_ids`` for an encoder).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pagedllm.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from pagedllm.entrypoints.pooling_inputs import (PooledPrompt, PoolingInputs, PoolingParamsArg,
                                                 rerank_prompt)  # noqa: F401 (rerank_prompt: re-exported)
from pagedllm.pooling_params import POOLING_TASKS


@dataclass(frozen=True)
class PooledResult:
    request_id: str
    data: torch.Tensor  # float32, as the task returns it (see ``worker/pooler.py``)
    num_cached_tokens: int = 0


class PoolingBackend(Protocol):
    """What runs pooling inputs: ``DecoderEngineBackend`` or ``EncoderBackend``."""

    inputs: PoolingInputs  # how its inputs are built (tokenizer, length, tasks, pair rendering)

    def run(self, inputs: Sequence[PooledPrompt], use_tqdm: bool) -> list[PooledResult]:
        """One result per input, in order."""


class DecoderEngineBackend:
    """Pooling through the engine: each input is a request with ``PoolingParams``."""

    def __init__(self, engine: Any, drive: Callable[..., list[Any]]) -> None:
        self.engine = engine
        self.drive = drive
        # (An engine-core proxy or a fleet generates: a pooling LLM keeps its engine in this process.)
        spec = getattr(engine, "pooler_spec", None)
        self.inputs = PoolingInputs.of_decoder(engine.get_tokenizer(), spec, getattr(engine, "max_model_len", 0),
                                               "create the LLM with runner='pooling' (LLM.generate is what it serves)")

    def run(self, inputs: Sequence[PooledPrompt], use_tqdm: bool) -> list[PooledResult]:
        outputs = self.drive(list(inputs), lambda engine, rid, item, i: engine.add_request(
            rid, {"prompt_token_ids": item.token_ids, "prompt": item.prompt}, item.params), use_tqdm)
        return [PooledResult(output.request_id, output.outputs.data, output.num_cached_tokens) for output in outputs]


class EncoderBackend:
    """Pooling by an encoder-only checkpoint: no KV blocks, one pass per batch."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.inputs = encoder_inputs(runner, "runner='pooling'")
        self._next_id = 0

    def run(self, inputs: Sequence[PooledPrompt], use_tqdm: bool) -> list[PooledResult]:
        results = run_encoder(self.runner, inputs)
        self._next_id += len(results)
        return [PooledResult(str(self._next_id - len(results) + i), data) for i, data in enumerate(results)]


def run_encoder(runner: Any, inputs: Sequence[PooledPrompt]) -> list[torch.Tensor]:
    """``inputs`` through an ``EncoderPoolingRunner`` in one call (it packs them by its token budget)."""
    from pagedllm.pooling.encoder_runner import PoolingInput

    return runner.run([PoolingInput(i.token_ids, i.params, i.token_type_ids, i.num_prompt_tokens) for i in inputs])


def encoder_inputs(runner: Any, what_to_pass: str) -> PoolingInputs:
    """How an ``EncoderPoolingRunner``'s inputs are built (text pairs by its tokenizer, the instruction
    prompts of its sentence-transformers folder)."""
    return PoolingInputs(runner.tokenizer, runner.max_model_len, tuple(runner.supported_tasks), None, what_to_pass,
                         runner.st.instruction_prompts())


class NoEngine:
    """The ``llm_engine`` of an encoder LLM: its tokenizer, and every other engine method says
    what it serves instead."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:  # nothing to stop: the encoder runs in this process
        return None

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"this LLM pools with an encoder-only model, which has no engine ({name}): "
                         "use embed, classify, score or encode")


def is_encoder_model(model: str | None, options: dict[str, Any]) -> bool:
    """Whether a pooling ``model`` is an encoder checkpoint folder (run by the encoder runner, no engine)."""
    import importlib.util

    if model is None or not Path(model).is_dir() or options.get("runner", "generate") == "generate":
        return False
    if importlib.util.find_spec("pagedllm.pooling") is None:
        return False  # (this build carries no encoder runner)
    from pagedllm.pooling.encoder_runner import is_encoder_checkpoint

    return is_encoder_checkpoint(Path(model))


def encoder_runner_for(model: str | None, options: dict[str, Any]) -> Any | None:
    """The ``EncoderPoolingRunner`` of an encoder checkpoint folder (None: not one)."""
    if not is_encoder_model(model, options):
        return None
    from pagedllm.config.engine import torch_dtype
    from pagedllm.pooling.encoder_runner import EncoderPoolingRunner

    dtype = torch_dtype(options.get("dtype", "float32") if options.get("dtype") != "auto" else "float32")
    return EncoderPoolingRunner.from_folder(Path(model), dtype, options.get("max_num_batched_tokens") or 8192)


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a dict, token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or a list of them")
    return list(prompts)


class PoolingMethods:
    """``LLM``'s pooling methods, over its ``pooling_backend`` (a ``PoolingBackend``)."""

    pooling_backend: PoolingBackend

    def embed(self, prompts: Any, pooling_params: PoolingParamsArg = None, *,
              truncate_prompt_tokens: int | None = None, prompt_name: str | None = None,
              instruction: str | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``, a list of floats), in prompt order.

        ``pooling_params``: one ``PoolingParams`` for all prompts or a list, one per prompt.
        Each text prompt gets an instruction in front, as ``SentenceTransformer.encode`` picks it:
        ``instruction`` (its ``prompt``; "" for none), else the model's prompt named ``prompt_name``,
        else its ``default_prompt_name``'s (``config_sentence_transformers.json``)."""
        inputs = self.pooling_backend.inputs.prompts(as_prompt_list(prompts), pooling_params, "embed",
                                                     truncate_prompt_tokens, prompt_name, instruction)
        return self._outputs(inputs, use_tqdm, EmbeddingRequestOutput, lambda data: EmbeddingOutput(data.tolist()))

    def classify(self, prompts: Any, pooling_params: PoolingParamsArg = None, *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``.outputs.probs``: softmax over the labels, sigmoid for one)."""
        return self._pooled(prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm,
                            ClassificationRequestOutput, lambda data: ClassificationOutput(data.tolist()))

    def encode(self, prompts: Any, pooling_params: PoolingParamsArg = None, *, pooling_task: str = "encode",
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The raw pooled tensor per prompt (``.outputs.data``) for ``pooling_task``
        (``encode``: every token's last hidden state, ``[T, H]``)."""
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}")
        return self._pooled(prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm,
                            PoolingRequestOutput, PoolingOutput)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              pooling_params: PoolingParamsArg = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """The relevance score of each text pair (``.outputs.score``): one-to-one
        (lists of equal length) or one-to-many (one text and a list), in pair order."""
        inputs = self.pooling_backend.inputs.pairs(data_1, data_2, pooling_params, truncate_prompt_tokens)
        return self._outputs(inputs, use_tqdm, ScoringRequestOutput, lambda data: ScoringOutput(float(data[0])))

    def _pooled(self, prompts: Any, pooling_params: PoolingParamsArg, task: str,
                truncate_prompt_tokens: int | None, use_tqdm: bool, cls: type[PoolingRequestOutput],
                wrap: Callable[[torch.Tensor], Any]) -> list:
        inputs = self.pooling_backend.inputs.prompts(as_prompt_list(prompts), pooling_params, task,
                                                     truncate_prompt_tokens)
        return self._outputs(inputs, use_tqdm, cls, wrap)

    def _outputs(self, inputs: Sequence[PooledPrompt], use_tqdm: bool, cls: type[PoolingRequestOutput],
                 wrap: Callable[[torch.Tensor], Any]) -> list:
        """Run ``inputs`` and wrap each result's data (``wrap``) in a ``cls`` output, in input order."""
        return [cls(result.request_id, wrap(result.data), item.token_ids, num_cached_tokens=result.num_cached_tokens,
                    prompt=item.prompt)
                for item, result in zip(inputs, self.pooling_backend.run(inputs, use_tqdm))]
