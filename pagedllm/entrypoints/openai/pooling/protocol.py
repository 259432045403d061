"""Request bodies of the pooling routes, as OpenAI (``/v1/embeddings``) and vLLM
(``/score``, ``/rerank``, ``/classify``, ``/pooling``) and Cohere (``/v2/rerank``)
spell them. As on the other routes, a field of their APIs that pagedllm does not
implement is a 400 naming it unless it has its harmless value, and a truly
unknown field is ignored and logged once per name (``request_fields``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.common.request_fields import FieldCheckedModel
from pagedllm.pooling_params import POOLING_TASKS

# One input or a batch: a string, strings, token ids, or token-id lists (OpenAI's ``input``).
PoolingInput = str | list[str] | list[int] | list[list[int]]
# Fields of vLLM's pooling requests that pagedllm does not implement, with the values that ask for nothing.
UNIMPLEMENTED_POOLING_FIELDS: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": (True,), "priority": (0,), "request_id": (), "mm_processor_kwargs": ({},),
    "kv_transfer_params": (), "additional_data": (), "embed_dtype": ("float32",), "endianness": ("native",),
    "return_tokens": (False,), "max_tokens_per_doc": (), "rank_fields": (), "softmax": (True,),
    "activation": (True,), "encoding_format": ("float",), "dimensions": (), "normalize": (),
}
# -1: the most tokens the model takes; k: the last k tokens (vLLM's rule).
TRUNCATE = Field(default=None, ge=-1, description="keep each input's last k tokens (-1: as many as the model "
                                                  "takes); unset, an input over the model's length is a 400")


class PoolingRequestBase(FieldCheckedModel):
    # (A route's own fields take precedence over the table: each declares what it implements.)
    unimplemented_fields: ClassVar[dict[str, tuple[Any, ...]]] = UNIMPLEMENTED_POOLING_FIELDS

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = TRUNCATE
    cache_salt: str | None = None  # a decoder's prefix-cache salt (a tenant's key sets its own)


class EmbeddingRequest(PoolingRequestBase):
    """OpenAI's ``POST /v1/embeddings``."""

    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="the first n numbers of each embedding "
                                                                    "(Matryoshka models), normalized again")
    normalize: bool | None = None  # None: the model's own rule (its Normalize module, or a decoder's default)
    # One of the model's instruction prompts (config_sentence_transformers.json) before each text input;
    # unset: its default_prompt_name's, if it names one.
    prompt_name: str | None = None


class ScoreRequest(PoolingRequestBase):
    """vLLM's ``POST /score``: one text against each of a list, or two lists of equal length."""

    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None  # False: the raw logit instead of the score


class RerankRequest(PoolingRequestBase):
    """Jina's (``/rerank``, ``/v1/rerank``) and Cohere's (``/v2/rerank``) rerank body."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0, description="the best n results (unset or 0: all)")
    return_documents: bool = True


class ClassifyRequest(PoolingRequestBase):
    """vLLM's ``POST /classify``."""

    input: PoolingInput
    activation: bool | None = None  # False: the raw logits instead of probabilities


class PoolingRequest(PoolingRequestBase):
    """vLLM's ``POST /pooling``: the raw pooled data of a task (``encode``: every token's hidden state)."""

    input: PoolingInput
    task: Literal[POOLING_TASKS] = "encode"  # type: ignore[valid-type]
    encoding_format: Literal["float", "base64"] = "float"
