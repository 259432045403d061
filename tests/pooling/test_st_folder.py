"""Reading a sentence-transformers folder's JSON (no torch, no weights) and the runner's refusals."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.pooling.encoder_runner import EncoderPoolingRunner, PoolingInput, is_encoder_checkpoint
from pagedllm.pooling.st_folder import PoolingConfig, pooling_config, read_st_folder
from pagedllm.pooling_params import PoolingParams
from tests.pooling.conftest import save_tiny, write_json

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"


@pytest.mark.parametrize("config, expected", [
    ({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, PoolingConfig(("mean",))),
    ({"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}, PoolingConfig(("cls", "max"))),
    ({"pooling_mode_lasttoken": True, "include_prompt": False}, PoolingConfig(("lasttoken",), include_prompt=False)),
    ({}, PoolingConfig(("mean",))),  # no mode named: mean, as sentence-transformers defaults
    ({"pooling_mode": "weightedmean"}, PoolingConfig(("weightedmean",))),
    # The new key wins over legacy booleans left beside it.
    ({"pooling_mode": ["cls", "mean"], "pooling_mode_max_tokens": True}, PoolingConfig(("cls", "mean"))),
])
def test_pooling_config_reads_new_and_legacy_keys(config, expected):
    assert pooling_config(config) == expected


def test_an_unknown_pooling_mode_is_refused():
    with pytest.raises(ValueError, match="pooling mode 'median'"):
        pooling_config({"pooling_mode": "median"})


def test_an_unsupported_module_is_named(tmp_path):
    write_json(tmp_path / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_LSTM", "type": "sentence_transformers.models.LSTM"},
    ])
    write_json(tmp_path / "1_Pooling" / "config.json", {"pooling_mode": "mean"})
    with pytest.raises(ValueError, match="sentence_transformers.models.LSTM"):
        read_st_folder(tmp_path)


def test_folder_settings_and_prompts(tmp_path):
    write_json(tmp_path / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.sentence_transformer.modules.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(tmp_path / "1_Pooling" / "config.json", {"pooling_mode": "lasttoken", "include_prompt": False})
    write_json(tmp_path / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": True})
    write_json(tmp_path / "config_sentence_transformers.json",
               {"prompts": {"query": "Instruct: search\nQuery: "}, "default_prompt_name": "query"})
    folder = read_st_folder(tmp_path)
    assert folder.pooling == PoolingConfig(("lasttoken",), include_prompt=False)
    assert folder.normalize and folder.dense == () and folder.model_folder == tmp_path
    assert (folder.max_seq_length, folder.do_lower_case) == (512, True)
    assert folder.prompts == {"query": "Instruct: search\nQuery: "} and folder.default_prompt_name == "query"


def test_a_plain_checkpoint_pools_cls_and_normalizes(tmp_path):
    """Without modules.json: vLLM's defaults for a BERT-style embedder."""
    folder = read_st_folder(tmp_path)
    assert folder.pooling == PoolingConfig(("cls",)) and folder.normalize and not folder.is_sentence_transformers


def test_reading_a_folder_does_not_import_torch():
    """st_folder alone in a fresh interpreter, the package's torch-loading facade left out."""
    script = textwrap.dedent(f"""
        import pathlib, sys, types
        package = types.ModuleType("pagedllm")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["pagedllm"] = package
        from pagedllm.pooling.st_folder import read_st_folder
        read_st_folder(pathlib.Path("."))
        print("torch" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory, minilm_folder) -> EncoderPoolingRunner:
    folder = tmp_path_factory.mktemp("tiny-bert")
    save_tiny(folder, minilm_folder, "bert")
    return EncoderPoolingRunner.from_folder(folder)


@pytest.mark.parametrize("item, message", [
    (PoolingInput([], PoolingParams(task="embed")), "input 0 is empty"),
    (PoolingInput([101] * 161, PoolingParams(task="embed")), "over the model's limit of 160.*truncate_prompt_tokens"),
    (PoolingInput([101, 102], PoolingParams(task="classify")), "task 'classify' is not supported.*embed, encode"),
    (PoolingInput([101, 102], PoolingParams(task="score")), "task 'score' is not supported"),
    (PoolingInput([101, 102], PoolingParams(task="embed", dimensions=33)), "over the embedding size 32"),
    (PoolingInput([101, 102], PoolingParams(task="embed"), token_type_ids=[0]), "token_type_ids has 1 entries"),
    (PoolingInput([101, 102], PoolingParams(task="embed"), token_type_ids=[0, 2]), "token_type_ids must be in 0..1"),
])
def test_bad_inputs_are_refused(tiny_runner, item, message):
    with pytest.raises(ValueError, match=message):
        tiny_runner.run([item])


def test_checkpoint_detection(tmp_path, minilm_folder):
    assert is_encoder_checkpoint(minilm_folder)
    write_json(tmp_path / "config.json", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert not is_encoder_checkpoint(tmp_path)
    assert not is_encoder_checkpoint(tmp_path / "missing")
