"""GGUF weights kept in their packed llama.cpp blocks and multiplied by a kernel
that decodes them tile by tile (see docs/architecture.md, "Model")."""

from pagedllm.model.quantized.install import install_packed_weights
from pagedllm.model.quantized.modules import PackedEmbedding, QuantizedLinear
from pagedllm.model.quantized.packed import PACKED_TYPES, PackedWeight, dequantize_rows

__all__ = ["PACKED_TYPES", "PackedEmbedding", "PackedWeight", "QuantizedLinear", "dequantize_rows",
           "install_packed_weights"]
