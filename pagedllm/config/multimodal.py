"""Images in the prompt: how many a prompt may hold, how large they may be, and
where a server may read them from (vLLM's option names where vLLM has them).
Flat engine options (``LLM(model, limit_mm_per_prompt={"image": 2})``,
``--limit-mm-per-prompt '{"image": 2}'``)."""

from __future__ import annotations

from dataclasses import dataclass, field

MODALITIES = ("image",)


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: dict | None = field(
        default=None,
        metadata={"help": "most items of each modality one prompt may hold, e.g. '{\"image\": 2}' "
                          "(None: no count limit; the pool and max_model_len still bound a prompt)"},
    )
    max_image_pixels: int = field(
        default=16_777_216,
        metadata={"help": "most pixels (width x height) of one decoded image; a larger one is refused"},
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata={"help": "a folder whose files chat requests may name as file:// image URLs "
                          "(None: no local files; the server reads them with its own rights)"},
    )
    allowed_media_domains: str | None = field(
        default=None,
        metadata={"help": "comma-separated host names whose http(s) image URLs chat requests may name "
                          "(None: no remote fetches)"},
    )
    media_fetch_timeout_s: float = field(
        default=5.0, metadata={"help": "seconds a remote image URL may take to download"},
    )
    max_media_bytes: int = field(
        default=20 * 2**20, metadata={"help": "most bytes of one encoded image (data URL, file or download)"},
    )

    def __post_init__(self) -> None:
        limits = self.limit_mm_per_prompt or {}
        if not isinstance(limits, dict):
            raise ValueError(f"limit_mm_per_prompt must be a mapping like {{'image': 2}}, got {limits!r}")
        unknown = sorted(set(limits) - set(MODALITIES))
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: unknown modalities {unknown}; it takes {list(MODALITIES)}")
        for modality, count in limits.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0, got {count!r}")
        for name in ("max_image_pixels", "max_media_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.media_fetch_timeout_s, (int, float)) or self.media_fetch_timeout_s <= 0:
            raise ValueError(f"media_fetch_timeout_s must be a positive number, got {self.media_fetch_timeout_s!r}")

    def limit(self, modality: str) -> int | None:
        """Most items of ``modality`` in one prompt (None: no limit)."""
        return (self.limit_mm_per_prompt or {}).get(modality)

    @property
    def media_domains(self) -> frozenset[str]:
        return frozenset(host.strip().lower() for host in (self.allowed_media_domains or "").split(",") if host.strip())
