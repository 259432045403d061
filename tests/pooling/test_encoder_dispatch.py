"""``LLM``'s one pooling code path in front of an encoder checkpoint: a stand-in for
``pagedllm.pooling.encoder_runner`` (the contract's surface: ``is_encoder_checkpoint``,
``EncoderPoolingRunner``, ``PoolingInput``) records what the LLM hands it."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from pagedllm.pooling.st_folder import PoolingConfig, STFolder
from pagedllm.pooling_params import PoolingParams


@dataclass(frozen=True)
class _Input:
    token_ids: list[int]
    params: PoolingParams
    token_type_ids: list[int] | None = None
    num_prompt_tokens: int = 0


class _Runner:
    """Returns ``[len(tokens), first token]`` per input (``[T, 1]`` for encode), and keeps the inputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 32
        self.supported_tasks = ("classify", "score", "encode")
        self.st = STFolder(Path("."), PoolingConfig(("cls",)))  # no instruction prompts
        self.seen: list[_Input] = []

    def run(self, inputs):
        self.seen += inputs
        return [torch.ones(len(i.token_ids), 1) if i.params.task == "encode"
                else torch.tensor([float(len(i.token_ids)), float(i.token_ids[0])]) for i in inputs]


class _Pair:
    """A BERT-like pair tokenizer: ``[1] a [2] b [2]`` with segment ids (a list of texts: one each)."""

    def __call__(self, text, text_pair=None):
        if isinstance(text, list):
            return {"input_ids": [self(one)["input_ids"] for one in text]}
        first = [1] + [10 + len(w) for w in text.split()] + [2]
        if text_pair is None:
            return {"input_ids": first}
        second = [10 + len(w) for w in text_pair.split()] + [2]
        return {"input_ids": first + second, "token_type_ids": [0] * len(first) + [1] * len(second)}


def install_stand_in(monkeypatch, runner, encoder_folder: Path) -> None:
    """``pagedllm.pooling.encoder_runner`` as the stand-in: ``encoder_folder`` is its one encoder
    checkpoint, loaded as ``runner``."""
    module = types.ModuleType("pagedllm.pooling.encoder_runner")
    module.PoolingInput = _Input
    module.is_encoder_checkpoint = lambda folder: Path(folder) == encoder_folder
    module.EncoderPoolingRunner = types.SimpleNamespace(from_folder=lambda folder, dtype, budget: runner)
    package = types.ModuleType("pagedllm.pooling")
    package.__spec__ = importlib.machinery.ModuleSpec("pagedllm.pooling", None, is_package=True)
    monkeypatch.setitem(sys.modules, "pagedllm.pooling", package)
    monkeypatch.setitem(sys.modules, "pagedllm.pooling.encoder_runner", module)


@pytest.fixture
def encoder_llm(monkeypatch, tmp_path):
    runner = _Runner(_Pair())
    install_stand_in(monkeypatch, runner, tmp_path)
    return LLM(str(tmp_path), runner="pooling"), runner


def test_encoder_checkpoints_take_the_same_inputs(encoder_llm):
    llm, runner = encoder_llm
    [scored] = llm.score("a query", ["one document"], use_tqdm=False)
    assert runner.seen[-1].token_ids == [1, 11, 15, 2, 13, 18, 2]
    assert runner.seen[-1].token_type_ids == [0, 0, 0, 0, 1, 1, 1]
    assert runner.seen[-1].params.task == "score" and scored.outputs.score == 7.0
    [probs] = llm.classify([[5, 6, 7]], PoolingParams(use_activation=False), use_tqdm=False)
    assert probs.outputs.probs == [3.0, 5.0] and runner.seen[-1].params.use_activation is False
    [states] = llm.encode(["x " * 40], truncate_prompt_tokens=-1, use_tqdm=False)
    assert states.outputs.data.shape == (32, 1) and states.num_cached_tokens == 0
    # Texts (tokenized in one call), token ids and dicts mixed in one call keep their order.
    llm.classify(["a query", [5, 6, 7], {"prompt": "one document"}, "x yz"], use_tqdm=False)
    assert [item.token_ids for item in runner.seen[-4:]] == [[1, 11, 15, 2], [5, 6, 7], [1, 13, 18, 2], [1, 11, 12, 2]]


def test_encoder_errors_say_what_to_change(encoder_llm):
    llm, _ = encoder_llm
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.classify(["x " * 40], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support the 'embed' task"):
        llm.embed(["x"], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.score("", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="equal length"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="encoder-only"):
        llm.generate(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="encoder-only"):
        llm.stats()
    llm.shutdown()
