"""The tiny random Idefics3 every multimodal engine test runs on, written once per session."""

from __future__ import annotations

import pytest

from tests.multimodal.tiny_models import make_tiny_idefics3


@pytest.fixture(scope="session")
def idefics3(tmp_path_factory, tiny_llama) -> str:
    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), tiny_llama)
