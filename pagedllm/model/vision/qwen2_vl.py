"""The Qwen2-VL and Qwen2.5-VL vision transformers: a 3-D convolution over patches of two
frames (an image is its own frame twice), a 2-D rotary embedding of each patch's (row,
column), pre-norm blocks of bidirectional attention, and ``PatchMerger`` (each 2x2 square of
patches, which the processor already lays out next to each other, becomes one decoder-width
row). Images are of any size (dynamic resolution): the processor's ``image_grid_thw`` says how
many patches in time, height and width. Qwen2-VL: LayerNorm, a two-layer MLP, attention
over each frame. Qwen2.5-VL: RMSNorm, a gated MLP, and attention within windows of merged
patches except in its ``fullatt_block_indexes`` blocks (the patches are reordered window by
window, and the merged rows put back in raster order). Parameter names match Hugging Face's
``visual`` module (``blocks.N.attn.qkv`` ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model.layers import RMSNorm
from pagedllm.model.vision.encoder import activation


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, config: PretrainedConfig, width: int) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, width, kernel_size=self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[patches, channels * frames * size * size] (the processor's flattening) -> [patches, width]."""
        return self.proj(pixel_values.view(-1, *self.shape)).flatten(1)


class TwoLayerMLP(nn.Module):
    """Qwen2-VL's: fc1, the activation, fc2."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(width, hidden), nn.Linear(hidden, width), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.down_proj = nn.Linear(hidden, width)
        self.act = F.silu if act == "silu" else activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Norm, attention (fused biased q/k/v, the 2-D rotation in fp32) within segments, norm, MLP."""

    def __init__(self, width: int, num_heads: int, norm: type[nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1, self.norm2 = norm(width, eps=1e-6), norm(width, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(width, 3 * width)
        self.attn.proj = nn.Linear(width, width)
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[patches, width]: each run of ``lengths`` patches attends within itself, both ways."""
        length = hidden.shape[0]
        q, k, v = self.attn.qkv(self.norm1(hidden)).view(length, 3, self.num_heads, -1).unbind(1)
        q, k = ((x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype) for x in (q, k))
        out = torch.cat([F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in parts)).transpose(0, 1)
                         for parts in zip(q.split(lengths), k.split(lengths), v.split(lengths))])
        hidden = hidden + self.attn.proj(out.reshape(length, -1))
        return hidden + self.mlp(self.norm2(hidden))


class PatchMerger(nn.Module):
    """Norm, then each ``merge x merge`` square of patches (consecutive rows) through a GELU MLP."""

    def __init__(self, width: int, out_width: int, merge: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.width = width * merge**2
        self.ln_q = norm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(hidden).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's tower: one image's patches in, its decoder-width rows out (``merge^2`` patches a row)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        width = config.embed_dim
        self._build(config, width, config.hidden_size, nn.LayerNorm,
                    lambda: TwoLayerMLP(width, int(width * config.mlp_ratio), config.hidden_act))

    def _build(self, config: PretrainedConfig, width: int, out_width: int, norm: type[nn.Module], mlp) -> None:
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config, width)
        self.blocks = nn.ModuleList(VisionBlock(width, config.num_heads, norm, mlp()) for _ in range(config.depth))
        self.merger = PatchMerger(width, out_width, self.merge, norm)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = width // config.num_heads // 2  # h and w each rotate a quarter of a head, twice
        with torch.device("cpu"):  # not a weight: computed on the CPU, moved with the model
            inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, grid: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim] of each patch's (row, column), in the processor's
        patch order (``merge x merge`` squares in raster order, raster order inside each)."""
        frames, height, width = grid
        merge = self.merge
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        blocks = (height // merge, merge, width // merge, merge)
        ids = torch.stack([x.reshape(blocks).transpose(1, 2).flatten() for x in (rows, cols)], dim=-1).repeat(frames, 1)
        freqs = ids.to(self.inv_freq.device)[..., None].float() * self.inv_freq
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1).repeat(1, 2)[:, None, :]
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        """``pixel_values`` [patches, ...] of one image and its ``(t, h, w)`` patch grid ->
        [patches / merge^2, decoder width]. Attention runs within each frame (Hugging Face's ``cu_seqlens``)."""
        hidden = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype))
        cos, sin = self.rotary(grid)
        frames = [grid[1] * grid[2]] * grid[0]
        for block in self.blocks:
            hidden = block(hidden, cos, sin, frames)
        return self.merger(hidden)


class Qwen25VisionTransformer(Qwen2VisionTransformer):
    """Qwen2.5-VL's tower: window attention but in the ``fullatt_block_indexes`` blocks."""

    def __init__(self, config: PretrainedConfig) -> None:
        nn.Module.__init__(self)
        width = config.hidden_size
        self._build(config, width, config.out_hidden_size, RMSNorm,
                    lambda: GatedMLP(width, config.intermediate_size, config.hidden_act))
        self.full_blocks = frozenset(config.fullatt_block_indexes)
        self.window_size, self.patch_size = config.window_size, config.patch_size

    def forward(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        # transformers' own window arithmetic, so the windows cannot drift from Hugging Face's.
        from transformers.vision_utils import get_vision_window_index

        order, bounds = get_vision_window_index(torch.tensor([grid]), self.merge, self.window_size, self.patch_size)
        unit = self.merge**2
        patches = (order[:, None] * unit + torch.arange(unit)).flatten()  # window by window
        hidden = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype))[patches]
        cos, sin = (x[patches] for x in self.rotary(grid))
        windows, frames = bounds.diff().tolist(), [grid[1] * grid[2]] * grid[0]
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, frames if index in self.full_blocks else windows)
        return self.merger(hidden)[torch.argsort(order)]
