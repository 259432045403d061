"""The model registry: every supported architecture maps to a class that is a
``CausalLM``, and the model modules stand below the registry (never import it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Cohere2Config, Gemma2Config, LlamaConfig, PhiConfig

import pagedllm
from pagedllm.model.base import CausalLM
from pagedllm.model.registry import SUPPORTED_ARCHITECTURES, model_class_for
from tests.conftest import TINY_COMMON


@pytest.mark.parametrize("config", [
    LlamaConfig(**TINY_COMMON, vocab_size=64),
    Gemma2Config(**TINY_COMMON, vocab_size=64, head_dim=16, sliding_window=8),
    Cohere2Config(**TINY_COMMON, vocab_size=64, sliding_window=8),
], ids=["llama", "gemma2", "cohere2"])
def test_each_family_is_a_causal_lm(config):
    with torch.device("meta"):
        model = model_class_for(config)(config, max_position=64)
    assert isinstance(model, CausalLM)
    assert model.num_kv_heads == 2 and not model.rope_depends_on_length
    assert config.model_type in SUPPORTED_ARCHITECTURES


def test_an_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture 'phi'; supported: llama, mistral"):
        model_class_for(PhiConfig())


def test_the_model_modules_never_import_the_registry():
    """Imported in a fresh interpreter without the package's ``__init__`` (which
    imports the engine, and so the registry, for the public API)."""
    script = textwrap.dedent(f"""
        import sys, types
        package = types.ModuleType("pagedllm")
        package.__path__ = [{pagedllm.__path__[0]!r}]
        sys.modules["pagedllm"] = package
        import pagedllm.model.llama, pagedllm.model.gemma, pagedllm.model.cohere2
        print("pagedllm.model.registry" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
