"""The GGUF file of `pagedllm bench moe`: a qwen3moe model of Qwen3-30B-A3B's layer shapes,
a few layers deep, with random weights written directly as valid GGUF blocks.

gguf-py cannot quantize Q4_K, and quantizing a few GiB of random floats in numpy would take
minutes, so every quantized tensor is written as random blocks: Q4_K blocks with fixed fp16
``d`` / ``dmin`` (``dmin`` = 7.5 ``d`` keeps the weights' mean near zero) and random 6-bit
scales, mins and nibbles; Q8_0 blocks with a fixed fp16 scale and random int8 weights. The
weights' standard deviation is a few hundredths, as an initialised model's. Types: the
experts Q4_K (the issue's type), every other matrix Q8_0 (attention, embedding, LM head),
the routers and norms F32 (llama.cpp keeps ``ffn_gate_inp`` F32 in its K-quant mixes too).
The tokenizer is the embedded SmolLM2 GGUF's metadata, copied key by key, so llama.cpp and
pagedllm both accept the file; the vocabulary is its 49152 tokens.

Tensors are streamed to the file one at a time (``GGUFWriter.add_tensor_info`` then
``write_tensor_data``), so writing the ~1.5 GiB default model holds one stack in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCH = "qwen3moe"
# GGML type ids and their block sizes (weights, bytes), as gguf.GGML_QUANT_SIZES lists them.
F32, Q8_0, Q4_K = 0, 8, 12
BLOCKS = {F32: (1, 4), Q8_0: (32, 34), Q4_K: (256, 144)}
_Q8_0_SCALE = 3e-4  # x int8 in [-128, 127]: std ~ 0.02
_Q4_K_D = 1.2e-4  # x 6-bit scale x nibble - 7.5 d x 6-bit min: std ~ 0.03


@dataclass(frozen=True)
class MoeShape:
    """A qwen3moe model's sizes; the defaults are Qwen3-30B-A3B's layers, 4 of them deep."""

    hidden: int = 2048
    layers: int = 4
    experts: int = 128
    active: int = 8
    expert_width: int = 768
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    # Qwen3-30B-A3B's intermediate_size (its metadata's feed_forward_length); no layer here is dense.
    dense_width: int = 6144
    vocab: int = 49152  # the copied SmolLM2 tokenizer's

    def tag(self) -> str:
        """The cache file's name part: every size that changes the file."""
        return (f"h{self.hidden}-l{self.layers}-e{self.experts}x{self.active}-w{self.expert_width}"
                f"-a{self.heads}x{self.kv_heads}x{self.head_dim}-v{self.vocab}")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order: [..., rows, columns]
    qtype: int
    expert_stack: bool = False  # [experts, rows, columns]: a token reads only its active experts'

    @property
    def nbytes(self) -> int:
        weights, size = BLOCKS[self.qtype]
        if self.shape[-1] % weights:
            raise ValueError(f"{self.name}: {self.shape[-1]} columns are not whole {weights}-weight blocks; "
                             f"choose sizes that are multiples of {weights}")
        return int(np.prod(self.shape[:-1])) * self.shape[-1] // weights * size


def tensor_specs(shape: MoeShape) -> list[TensorSpec]:
    """Every tensor of the file, in file order."""
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs = [TensorSpec("token_embd.weight", (shape.vocab, shape.hidden), Q8_0),
             TensorSpec("output_norm.weight", (shape.hidden,), F32),
             TensorSpec("output.weight", (shape.vocab, shape.hidden), Q8_0)]
    for layer in range(shape.layers):
        blk = f"blk.{layer}"
        specs += [
            TensorSpec(f"{blk}.attn_norm.weight", (shape.hidden,), F32),
            TensorSpec(f"{blk}.attn_q.weight", (q_rows, shape.hidden), Q8_0),
            TensorSpec(f"{blk}.attn_k.weight", (kv_rows, shape.hidden), Q8_0),
            TensorSpec(f"{blk}.attn_v.weight", (kv_rows, shape.hidden), Q8_0),
            TensorSpec(f"{blk}.attn_output.weight", (shape.hidden, q_rows), Q8_0),
            TensorSpec(f"{blk}.attn_q_norm.weight", (shape.head_dim,), F32),
            TensorSpec(f"{blk}.attn_k_norm.weight", (shape.head_dim,), F32),
            TensorSpec(f"{blk}.ffn_norm.weight", (shape.hidden,), F32),
            TensorSpec(f"{blk}.ffn_gate_inp.weight", (shape.experts, shape.hidden), F32),
            TensorSpec(f"{blk}.ffn_gate_exps.weight", (shape.experts, shape.expert_width, shape.hidden), Q4_K, True),
            TensorSpec(f"{blk}.ffn_up_exps.weight", (shape.experts, shape.expert_width, shape.hidden), Q4_K, True),
            TensorSpec(f"{blk}.ffn_down_exps.weight", (shape.experts, shape.hidden, shape.expert_width), Q4_K, True),
        ]
    return specs


def bytes_per_token(shape: MoeShape) -> int:
    """The file bytes one decoded token reads at least once: every dense tensor whole, the
    active experts' share of each expert stack, one row of the embedding."""
    total = 0
    for spec in tensor_specs(shape):
        if spec.name == "token_embd.weight":
            total += spec.nbytes // shape.vocab
        elif spec.expert_stack:
            total += spec.nbytes * shape.active // shape.experts
        else:
            total += spec.nbytes
    return total


def roofline_tokens_per_s(shape: MoeShape, bandwidth_gbps: float) -> float:
    """Batch 1's ceiling: tokens per second that reading ``bytes_per_token`` at this bandwidth allows."""
    return bandwidth_gbps * 1e9 / bytes_per_token(shape)


def _random_blocks(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """The tensor's data: float32 values in its shape, or uint8 [..., rows, bytes per row] of blocks."""
    if spec.qtype == F32:
        if spec.name.endswith("norm.weight"):
            return np.ones(spec.shape, dtype=np.float32)
        return (rng.standard_normal(spec.shape, dtype=np.float32) * 0.02).astype(np.float32)
    weights, size = BLOCKS[spec.qtype]
    blocks = np.frombuffer(rng.bytes(spec.nbytes), dtype=np.uint8).reshape(-1, size).copy()
    scales = [_Q8_0_SCALE] if spec.qtype == Q8_0 else [_Q4_K_D, 7.5 * _Q4_K_D]
    header = np.array(scales, dtype=np.float16).view(np.uint8)
    blocks[:, :header.size] = header
    return blocks.reshape(*spec.shape[:-1], spec.shape[-1] // weights * size)


def _add_metadata(writer, shape: MoeShape, tokenizer: TokenizerKeys) -> None:
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.dense_width)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.active)
    writer.add_expert_feed_forward_length(shape.expert_width)
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M: the experts' type names the file
    tokenizer.write(writer)


@dataclass(frozen=True)
class TokenizerKeys:
    """Every ``tokenizer.*`` key of a GGUF file, read once, to be written to other files."""

    fields: tuple[tuple[str, object, list], ...]  # (key, value, value types)
    size: int  # how many tokens it lists

    @classmethod
    def read(cls, source: str | Path) -> TokenizerKeys:
        import gguf

        reader = gguf.GGUFReader(str(source))  # ~2 s on a 49k-token vocabulary
        fields = tuple((key, field.contents(), field.types) for key, field in reader.fields.items()
                       if key.startswith("tokenizer."))
        return cls(fields, len(reader.fields["tokenizer.ggml.tokens"].data))

    def write(self, writer) -> None:
        for key, value, types in self.fields:
            writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)


def _stream(specs: list[TensorSpec], seed: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    for spec in specs:
        yield _random_blocks(spec, rng)


def write_moe_gguf(path: Path, shape: MoeShape, tokenizer: TokenizerKeys, seed: int = 0) -> Path:
    """Write the model to ``path`` (see the module's docstring); returns ``path``."""
    import gguf

    if shape.vocab != tokenizer.size:
        raise ValueError(f"vocab {shape.vocab} differs from the tokenizer's {tokenizer.size} tokens: "
                         f"give the shape the tokenizer's vocabulary size")
    specs = tensor_specs(shape)
    writer = gguf.GGUFWriter(path, ARCH)
    _add_metadata(writer, shape, tokenizer)
    for spec in specs:
        dtype, raw = (np.float32, None) if spec.qtype == F32 else (np.uint8, gguf.GGMLQuantizationType(spec.qtype))
        byte_shape = spec.shape if raw is None else (*spec.shape[:-1], spec.nbytes // int(np.prod(spec.shape[:-1])))
        writer.add_tensor_info(spec.name, byte_shape, np.dtype(dtype), spec.nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in _stream(specs, seed):
        writer.write_tensor_data(data)
    writer.close()
    return path


def cached_moe_gguf(workdir: Path, shape: MoeShape, tokenizer_source: str | Path) -> Path:
    """The model's file under ``workdir``, written once (through a .partial name, so a killed
    write is never reused) and reused by later runs."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"qwen3moe-{shape.tag()}-Q4_K.gguf"
    if not path.exists():
        print(f"writing {path}")
        write_moe_gguf(path.with_suffix(".partial"), shape, TokenizerKeys.read(tokenizer_source)).rename(path)
    return path
