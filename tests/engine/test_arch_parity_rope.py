"""Every rope scaling type, greedy token for token against Hugging Face.

The windows are tiny (32 positions) so prompts and generations cross them:
dynamic NTK and longrope change their frequencies for tokens beyond it, each
token by its own sequence length (see pagedllm/model/rotary.py).
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from tests.conftest import TINY_COMMON
from tests.engine.arch_parity import check_greedy_parity, write_checkpoint

WINDOW = 32
HALF_ROT = TINY_COMMON["hidden_size"] // TINY_COMMON["num_attention_heads"] // 2
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": WINDOW},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": WINDOW,
                 "short_factor": [1.0 + 0.1 * i for i in range(HALF_ROT)],
                 "long_factor": [1.0 + 2.0 * i for i in range(HALF_ROT)]},
}


def rope_config(name: str) -> LlamaConfig:
    # dynamic NTK scales past max_position_embeddings; the others run 4x their original window.
    window = WINDOW if name == "dynamic" else 4 * WINDOW
    return LlamaConfig(**{**TINY_COMMON, "max_position_embeddings": window}, tie_word_embeddings=True,
                       rope_parameters={"rope_theta": 10000.0, **ROPES[name]})


@pytest.mark.slow  # ~35 s each: Hugging Face generates 200 tokens per case
@pytest.mark.parametrize("name", list(ROPES))
def test_rope_scaling_matches_hf(name, tmp_path, smollm_tokenizer):
    folder = write_checkpoint(tmp_path, rope_config(name), smollm_tokenizer)
    # Prompts inside the window grow past it while decoding; 40 and 70 start beyond it.
    check_greedy_parity(folder, [5, 18, 31, 40, 70], new_tokens=40, chunked_up_to=WINDOW, max_model_len=4 * WINDOW)
