"""The Qwen2-VL vision transformer: a 3-D convolution over patches of two frames (an image
is its own frame twice), a 2-D rotary embedding of each patch's (row, column), pre-norm blocks
of bidirectional attention over one image's patches, and ``PatchMerger`` (each 2x2 square of
patches, which the processor already lays out next to each other, becomes one decoder-width
row). The images are of any size (dynamic resolution): the processor's ``image_grid_thw``
says how many patches in time, height and width. Parameter names match Hugging Face's
``visual`` module (``blocks.N.attn.qkv`` ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model.vision.encoder import activation


class PatchEmbed(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel_size=self.shape[1:], stride=self.shape[1:],
                              bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[patches, channels * frames * size * size] (the processor's flattening) -> [patches, width]."""
        return self.proj(pixel_values.view(-1, *self.shape)).flatten(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionBlock(nn.Module):
    """LayerNorm, attention (fused biased q/k/v, the 2-D rotation in fp32), LayerNorm, MLP."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.embed_dim
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim)
        self.attn.proj = nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, int(dim * config.mlp_ratio))
        self.mlp.fc2 = nn.Linear(int(dim * config.mlp_ratio), dim)
        self.act = activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[patches, width] of one frame of one image: every patch attends to every other."""
        length = hidden.shape[0]
        q, k, v = self.attn.qkv(self.norm1(hidden)).view(length, 3, self.num_heads, -1).unbind(1)
        q, k = ((x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype) for x in (q, k))
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)))
        hidden = hidden + self.attn.proj(out.transpose(0, 1).reshape(length, -1))
        return hidden + self.mlp.fc2(self.act(self.mlp.fc1(self.norm2(hidden))))


class PatchMerger(nn.Module):
    """LayerNorm, then each ``merge x merge`` square of patches (consecutive rows) through a GELU MLP."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.width = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, config.hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(hidden).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    """One image's patches in, its decoder-width rows out (``merge^2`` patches a row)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = config.embed_dim // config.num_heads // 2  # h and w each rotate a quarter of a head, twice
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
        frames = [part for part in zip(hidden.split(grid[1] * grid[2]), cos.split(grid[1] * grid[2]),
                                       sin.split(grid[1] * grid[2]))]
        for block in self.blocks:
            frames = [(block(h, c, s), c, s) for h, c, s in frames]
        return self.merger(torch.cat([h for h, _, _ in frames]))
