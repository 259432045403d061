"""Building pooling inputs: the one code path of ``LLM``'s pooling methods and the
server's pooling routes (``entrypoints/openai/pooling``).

Tokenization (text, token ids, ``{"prompt_token_ids"}`` dicts), an embedder's
instruction prompt put before each text as sentence-transformers puts it, truncation by
``truncate_prompt_tokens`` (the last tokens kept), text pairs (``tokenizer(text_1,
text_2)``, with BERT's ``token_type_ids``) or Qwen3-Reranker's template for a yes/no
decoder reranker, ``PoolingParams`` for all inputs or one per input, and the refusals
of an empty input or one over the model's length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.config.pooling import InstructionPrompts
from pagedllm.pooling.st_folder import prompt_token_count
from pagedllm.pooling_params import PoolingParams

# One PoolingParams for every input, one per input (in input order), or None (the defaults).
PoolingParamsArg = PoolingParams | Sequence[PoolingParams] | None

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
    # Its leading instruction-prompt tokens, as sentence-transformers counts them ([CLS] included), when
    # the model's Pooling config leaves them out (include_prompt: false); else 0.
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class _Instruction:
    """The instruction prompt of one call: its text, its tokens left out of pooling, and whether the call named it."""

    text: str = ""
    num_left_out: int = 0
    named: bool = False


@dataclass(frozen=True)
class PoolingInputs:
    """What building a model's pooling inputs needs of it, and the building."""

    tokenizer: Any
    max_input_len: int  # the longest input it takes
    supported_tasks: tuple[str, ...]  # empty: a generating model
    # Renders a (query, document) pair as one prompt (a yes/no reranker); None: a tokenizer text pair.
    pair_prompt: Callable[[str, str], str] | None
    what_to_pass: str  # what makes a pooling model of it (the LLM argument, the server flag)
    instructions: InstructionPrompts = InstructionPrompts()  # an embedder's prompts, put before embed inputs

    @classmethod
    def of_decoder(cls, tokenizer: Any, spec: Any, max_model_len: int, what_to_pass: str) -> PoolingInputs:
        """A decoder engine's (``spec``: its ``PoolerSpec``, None when it generates)."""
        return cls(tokenizer, 0 if spec is None else max_model_len - 1,  # a request's prompt and one token fit
                   () if spec is None else tuple(spec.tasks),
                   None if spec is None or spec.classifier_token_ids is None else rerank_prompt, what_to_pass,
                   InstructionPrompts() if spec is None else spec.prompts)

    def params(self, params: PoolingParams | None, task: str, truncate_prompt_tokens: int | None) -> PoolingParams:
        """``params`` for ``task``; ``ValueError`` when the model does not serve it."""
        params = (params or PoolingParams()).with_task(task)
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        if not self.supported_tasks:
            raise ValueError(f"this model generates text; to {task}, {self.what_to_pass}")
        if task not in self.supported_tasks:
            raise ValueError(f"this model does not support the {task!r} task; it serves "
                             f"{', '.join(self.supported_tasks)}")
        return params

    def params_per_input(self, params: PoolingParamsArg, count: int, task: str,
                         truncate_prompt_tokens: int | None) -> list[PoolingParams]:
        """The params of each of ``count`` inputs: ``params`` for all, or its entries one per input."""
        if params is None or isinstance(params, PoolingParams):
            return [self.params(params, task, truncate_prompt_tokens)] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"pooling_params has {len(params)} entries for {count} inputs: pass one PoolingParams "
                             "for all, or a list with one per input")
        return [self.params(p, task, truncate_prompt_tokens) for p in params]

    def prompts(self, prompts: list[Any], params: PoolingParamsArg, task: str, truncate_prompt_tokens: int | None,
                prompt_name: str | None = None, instruction: str | None = None) -> list[PooledPrompt]:
        """One input per prompt (a string, token ids, or a dict). An ``embed`` text input gets the
        instruction prompt ``instruction``, else the one named ``prompt_name``, else the model's default."""
        per_input = self.params_per_input(params, len(prompts), task, truncate_prompt_tokens)
        named = prompt_name is not None or instruction is not None
        if named and task != "embed":
            raise ValueError(f"prompt_name and instruction apply to the embed task, not {task!r}")
        text = self.instructions.resolve(prompt_name, instruction) if task == "embed" else ""
        left_out = prompt_token_count(self.tokenizer, text) if text and not self.instructions.include_prompt else 0
        prefix = _Instruction(text, left_out, named)
        prompts = [_unwrapped(prompt) for prompt in prompts]
        # The texts in one tokenizer call: a fast tokenizer encodes a batch in parallel, about
        # twice as fast as one call per text (and with the same ids).
        texts = [prefix.text + prompt for prompt in prompts if isinstance(prompt, str) and prompt]
        encoded = iter(self.tokenizer(texts)["input_ids"] if texts else [])
        return [self.checked(_prompt_input(prompt, p, prefix, i, encoded), i)
                for i, (prompt, p) in enumerate(zip(prompts, per_input))]

    def pairs(self, data_1: str | Sequence[str], data_2: str | Sequence[str], params: PoolingParamsArg,
              truncate_prompt_tokens: int | None) -> list[PooledPrompt]:
        """The ``score`` inputs of text pairs: one-to-one, or one text against each of a list."""
        pairs = _pairs(data_1, data_2)
        per_input = self.params_per_input(params, len(pairs), "score", truncate_prompt_tokens)
        if self.pair_prompt is not None:
            return self.prompts([self.pair_prompt(q, d) for q, d in pairs], per_input, "score", None)
        return [self.checked(_pair_input(self.tokenizer, q, d, p), i)
                for i, ((q, d), p) in enumerate(zip(pairs, per_input))]

    def checked(self, item: PooledPrompt, index: int) -> PooledPrompt:
        """``item`` cut to its ``truncate_prompt_tokens`` (its last tokens); ``ValueError`` when empty or too long."""
        limit = self.max_input_len
        keep = item.params.truncate_prompt_tokens
        if keep is not None:
            keep = limit if keep == -1 else keep
            dropped = max(0, len(item.token_ids) - keep)  # the first tokens: the instruction's go first
            item = replace(item, token_ids=item.token_ids[-keep:],
                           token_type_ids=None if item.token_type_ids is None else item.token_type_ids[-keep:],
                           num_prompt_tokens=max(0, item.num_prompt_tokens - dropped))
        if not item.token_ids:
            raise ValueError(f"input {index} is empty; pass at least one character or token id")
        if len(item.token_ids) > limit:
            raise ValueError(f"input {index} has {len(item.token_ids)} tokens but the model takes at most {limit}; "
                             "pass truncate_prompt_tokens (k: keep the last k tokens, -1: the most the model takes)")
        return item


def _unwrapped(prompt: Any) -> Any:
    """A dict holding only text (``{"prompt": ...}``) as that text."""
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return prompt


def _prompt_input(prompt: Any, params: PoolingParams, instruction: _Instruction, index: int,
                  encoded: Iterator[list[int]]) -> PooledPrompt:
    """One input; a text gets ``instruction`` in front (as sentence-transformers: the two strings joined,
    then tokenized: ``encoded`` holds the ids of every non-empty text, in order), token ids are the
    model's input as given."""
    if isinstance(prompt, str):
        if not prompt:
            return PooledPrompt([], params, prompt=prompt)
        return PooledPrompt(list(next(encoded)), params, prompt=instruction.text + prompt,
                            num_prompt_tokens=instruction.num_left_out)
    if instruction.named and instruction.text:
        raise ValueError(f"input {index} is token ids: prompt_name and instruction put text before text inputs; "
                         "pass text, or token ids that hold the instruction")
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return PooledPrompt(list(prompt["prompt_token_ids"]), params, prompt=prompt.get("prompt"))
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
