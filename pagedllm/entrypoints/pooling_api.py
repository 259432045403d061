"""``LLM``'s pooling methods (vLLM's ``embed``, ``classify``, ``score``, ``encode``).

One code path builds every pooling input (tokenization, truncation, text pairs)
and hands it to a ``PoolingBackend``: the engine for a decoder (its requests go
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from pagedllm.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from pagedllm.pooling_params import POOLING_TASKS, PoolingParams

# Qwen3-Reranker's prompt (its model card): a system turn asking for "yes" or "no",
# the instruction, the query, then the document; the answer's logits are read after it.
RERANK_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                 'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_prompt(query: str, document: str, instruction: str = RERANK_INSTRUCTION) -> str:
    """One query-document pair in Qwen3-Reranker's template (the query before the document)."""
    return f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{RERANK_SUFFIX}"


@dataclass(frozen=True)
class PooledPrompt:
    """One tokenized pooling input, ready for either backend."""

    token_ids: list[int]
    params: PoolingParams  # its task set
    token_type_ids: list[int] | None = None  # an encoder's segment ids of a text pair
    prompt: str | None = None


@dataclass(frozen=True)
class PooledResult:
    request_id: str
    data: torch.Tensor  # float32, as the task returns it (see ``worker/pooler.py``)
    num_cached_tokens: int = 0


class PoolingBackend(Protocol):
    """What runs pooling inputs: ``DecoderEngineBackend`` or ``EncoderBackend``."""

    tokenizer: Any
    max_input_len: int  # the longest input it takes
    supported_tasks: tuple[str, ...]
    # Renders a (query, document) pair as one prompt (a yes/no reranker); None: a tokenizer text pair.
    pair_prompt: Callable[[str, str], str] | None
    what_to_pass: str  # the LLM(...) argument that makes a pooling LLM of a model

    def run(self, inputs: Sequence[PooledPrompt], use_tqdm: bool) -> list[PooledResult]:
        """One result per input, in order."""


class DecoderEngineBackend:
    """Pooling through the engine: each input is a request with ``PoolingParams``."""

    what_to_pass = "runner='pooling'"

    def __init__(self, engine: Any, drive: Callable[..., list[Any]]) -> None:
        self.engine = engine
        self.drive = drive
        self.tokenizer = engine.get_tokenizer()
        # (An engine-core proxy or a fleet generates: a pooling LLM keeps its engine in this process.)
        spec = getattr(engine, "pooler_spec", None)
        self.supported_tasks = () if spec is None else spec.tasks
        self.pair_prompt = None if spec is None or spec.classifier_token_ids is None else rerank_prompt
        # A request's prompt and one token must fit the model.
        self.max_input_len = 0 if spec is None else engine.max_model_len - 1

    def run(self, inputs: Sequence[PooledPrompt], use_tqdm: bool) -> list[PooledResult]:
        outputs = self.drive(list(inputs), lambda engine, rid, item, i: engine.add_request(
            rid, {"prompt_token_ids": item.token_ids, "prompt": item.prompt}, item.params), use_tqdm)
        return [PooledResult(output.request_id, output.outputs.data, output.num_cached_tokens) for output in outputs]


class EncoderBackend:
    """Pooling by an encoder-only checkpoint: no KV blocks, one pass per batch."""

    what_to_pass = "runner='pooling' (an encoder checkpoint)"

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.max_input_len = runner.max_model_len
        self.supported_tasks = tuple(runner.supported_tasks)
        self.pair_prompt = None
        self._next_id = 0

    def run(self, inputs: Sequence[PooledPrompt], use_tqdm: bool) -> list[PooledResult]:
        from pagedllm.pooling.encoder_runner import PoolingInput

        results = self.runner.run([PoolingInput(i.token_ids, i.params, i.token_type_ids) for i in inputs])
        self._next_id += len(results)
        return [PooledResult(str(self._next_id - len(results) + i), data) for i, data in enumerate(results)]


class NoEngine:
    """The ``llm_engine`` of an encoder LLM: every engine method says what it serves instead."""

    def shutdown(self) -> None:  # nothing to stop: the encoder runs in this process
        return None

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"this LLM pools with an encoder-only model, which has no engine ({name}): "
                         "use embed, classify, score or encode")


def encoder_runner_for(model: str | None, options: dict[str, Any]) -> Any | None:
    """The ``EncoderPoolingRunner`` of an encoder checkpoint folder (None: not one)."""
    import importlib.util

    if model is None or not Path(model).is_dir() or options.get("runner", "generate") == "generate":
        return None
    if importlib.util.find_spec("pagedllm.pooling") is None:
        return None  # (this build carries no encoder runner)
    from pagedllm.config.engine import torch_dtype
    from pagedllm.pooling.encoder_runner import EncoderPoolingRunner, is_encoder_checkpoint

    if not is_encoder_checkpoint(Path(model)):
        return None
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

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``, a list of floats), in prompt order."""
        inputs = self._inputs(as_prompt_list(prompts), pooling_params, "embed", truncate_prompt_tokens)
        return [_output(EmbeddingRequestOutput, EmbeddingOutput(result.data.tolist()), item, result)
                for item, result in zip(inputs, self.pooling_backend.run(inputs, use_tqdm))]

    def classify(self, prompts: Any, pooling_params: PoolingParams | None = None, *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``.outputs.probs``: softmax over the labels, sigmoid for one)."""
        inputs = self._inputs(as_prompt_list(prompts), pooling_params, "classify", truncate_prompt_tokens)
        return [_output(ClassificationRequestOutput, ClassificationOutput(result.data.tolist()), item, result)
                for item, result in zip(inputs, self.pooling_backend.run(inputs, use_tqdm))]

    def encode(self, prompts: Any, pooling_params: PoolingParams | None = None, *, pooling_task: str = "encode",
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The raw pooled tensor per prompt (``.outputs.data``) for ``pooling_task``
        (``encode``: every token's last hidden state, ``[T, H]``)."""
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}")
        inputs = self._inputs(as_prompt_list(prompts), pooling_params, pooling_task, truncate_prompt_tokens)
        return [_output(PoolingRequestOutput, PoolingOutput(result.data), item, result)
                for item, result in zip(inputs, self.pooling_backend.run(inputs, use_tqdm))]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """The relevance score of each text pair (``.outputs.score``): one-to-one
        (lists of equal length) or one-to-many (one text and a list), in pair order."""
        pairs = _pairs(data_1, data_2)
        backend = self.pooling_backend
        params = self._params(pooling_params, "score", truncate_prompt_tokens)
        if backend.pair_prompt is not None:
            inputs = self._inputs([backend.pair_prompt(q, d) for q, d in pairs], params, "score", None)
        else:
            inputs = [self._checked(_pair_input(backend.tokenizer, q, d, params), i) for i, (q, d) in enumerate(pairs)]
        return [_output(ScoringRequestOutput, ScoringOutput(float(result.data[0])), item, result)
                for item, result in zip(inputs, backend.run(inputs, use_tqdm))]

    def _params(self, params: PoolingParams | None, task: str, truncate_prompt_tokens: int | None) -> PoolingParams:
        params = (params or PoolingParams()).with_task(task)
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        tasks = self.pooling_backend.supported_tasks
        if not tasks:
            raise ValueError(f"this LLM generates text: create it with {self.pooling_backend.what_to_pass} "
                             f"to {task} (LLM.generate is what it serves)")
        if task not in tasks:
            raise ValueError(f"this model does not support the {task!r} task; it serves {', '.join(tasks)}")
        return params

    def _inputs(self, prompts: list[Any], params: PoolingParams | None, task: str,
                truncate_prompt_tokens: int | None) -> list[PooledPrompt]:
        params = self._params(params, task, truncate_prompt_tokens)
        tokenizer = self.pooling_backend.tokenizer
        return [self._checked(_prompt_input(tokenizer, prompt, params), i) for i, prompt in enumerate(prompts)]

    def _checked(self, item: PooledPrompt, index: int) -> PooledPrompt:
        """``item`` cut to its ``truncate_prompt_tokens`` (its last tokens); ``ValueError`` when empty or too long."""
        limit = self.pooling_backend.max_input_len
        keep = item.params.truncate_prompt_tokens
        if keep is not None:
            keep = limit if keep == -1 else keep
            item = replace(item, token_ids=item.token_ids[-keep:],
                           token_type_ids=None if item.token_type_ids is None else item.token_type_ids[-keep:])
        if not item.token_ids:
            raise ValueError(f"input {index} is empty; pass at least one character or token id")
        if len(item.token_ids) > limit:
            raise ValueError(f"input {index} has {len(item.token_ids)} tokens but the model takes at most {limit}; "
                             "pass truncate_prompt_tokens (k: keep the last k tokens, -1: the most the model takes)")
        return item


def _prompt_input(tokenizer: Any, prompt: Any, params: PoolingParams) -> PooledPrompt:
    if isinstance(prompt, str):
        return PooledPrompt(list(tokenizer(prompt)["input_ids"]) if prompt else [], params, prompt=prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return PooledPrompt(list(prompt["prompt_token_ids"]), params, prompt=prompt.get("prompt"))
        if isinstance(prompt.get("prompt"), str):
            return _prompt_input(tokenizer, prompt["prompt"], params)
        raise ValueError("a dict prompt needs 'prompt_token_ids' (token ids) or 'prompt' (text)")
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return PooledPrompt(list(prompt), params)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _pair_input(tokenizer: Any, text_1: str, text_2: str, params: PoolingParams) -> PooledPrompt:
    """A text pair as the tokenizer joins two texts (with segment ids where it makes them)."""
    if not text_1 or not text_2:
        return PooledPrompt([], params)
    encoded = tokenizer(text_1, text_2)
    type_ids = encoded.get("token_type_ids")
    return PooledPrompt(list(encoded["input_ids"]), params, None if type_ids is None else list(type_ids))


def _pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one-to-one, or one text against each of a list."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not firsts or not seconds:
        raise ValueError("score needs at least one text on each side")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"score got {len(firsts)} and {len(seconds)} texts: pass lists of equal length "
                         "(one-to-one) or one text and a list (one-to-many)")
    return list(zip(firsts, seconds))


def _output(cls: type[PoolingRequestOutput], outputs: Any, item: PooledPrompt,
            result: PooledResult) -> PoolingRequestOutput:
    return cls(result.request_id, outputs, item.token_ids, num_cached_tokens=result.num_cached_tokens,
               prompt=item.prompt)
