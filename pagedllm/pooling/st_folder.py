"""Read a sentence-transformers folder's configuration as sentence-transformers 6.3 reads it.

``modules.json`` lists the modules in order: a Transformer (the encoder), Pooling,
optional Dense layers and Normalize. ``sentence_bert_config.json`` holds the
Transformer's ``max_seq_length`` and ``do_lower_case``;
``config_sentence_transformers.json`` the named instruction prompts. Only JSON is read
here (no torch): the Dense weights are loaded by ``poolers``. A folder without
``modules.json`` is a plain Hugging Face checkpoint: pooled with CLS and normalized,
vLLM's defaults for a BERT-style embedder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.config.pooling import InstructionPrompts

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# The legacy boolean keys, in the order sentence-transformers concatenates their outputs.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"  # Dense's default when its config names none


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[str, ...]       # concatenated in this order (usually one)
    include_prompt: bool = True  # False: the instruction prompt's tokens are not pooled


@dataclass(frozen=True)
class DenseConfig:
    folder: Path                 # holds model.safetensors (or pytorch_model.bin): linear.weight / linear.bias
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = _DEFAULT_ACTIVATION  # a torch.nn module's dotted path
    use_residual: bool = False


@dataclass(frozen=True)
class STFolder:
    model_folder: Path           # the Transformer module's folder (config.json, weights, tokenizer)
    pooling: PoolingConfig
    dense: tuple[DenseConfig, ...] = ()
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    is_sentence_transformers: bool = True  # False: a plain HF folder with the defaults above

    def instruction_prompts(self) -> InstructionPrompts:
        return InstructionPrompts(tuple(self.prompts.items()), self.default_prompt_name, self.pooling.include_prompt)


def prompt_token_count(tokenizer: Any, prompt: str) -> int:
    """An instruction prompt's token count as sentence-transformers measures it for
    include_prompt: the prompt tokenized alone, less its trailing special token (SEP / EOS)."""
    ids = tokenizer(prompt)["input_ids"]
    return len(ids) - 1 if ids and ids[-1] in tokenizer.all_special_ids else len(ids)


def decoder_st_settings(folder: Path) -> tuple[InstructionPrompts, bool]:
    """A decoder embedder's instruction prompts and whether it normalizes, from its
    sentence-transformers files (none: no prompts, normalized). A decoder is pooled at its
    last token, so a folder asking for another pooling or a Dense layer is a ValueError."""
    st = read_st_folder(folder)
    if not st.is_sentence_transformers:
        return st.instruction_prompts(), True
    if st.pooling.modes != ("lasttoken",) or st.dense:
        raise ValueError(f"{str(folder)!r}: its sentence-transformers modules ask for {'+'.join(st.pooling.modes)} "
                         f"pooling{' and Dense layers' if st.dense else ''}; a decoder embedder is pooled at its "
                         "last token only (pooling_mode lasttoken, no Dense)")
    return st.instruction_prompts(), st.normalize


def _short_type(type_name: str) -> str:
    """``sentence_transformers.models.Pooling`` and ``...sentence_transformer.modules.Pooling`` alike -> Pooling."""
    return type_name.rsplit(".", 1)[-1]


def pooling_config(config: dict) -> PoolingConfig:
    """A Pooling module's config.json: the ``pooling_mode`` key, else the legacy booleans."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key, False)) or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    for name in modes:
        if name not in POOLING_MODES:
            raise ValueError(f"pooling mode {name!r} is not supported; supported: {', '.join(POOLING_MODES)}")
    return PoolingConfig(modes=modes, include_prompt=bool(config.get("include_prompt", True)))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _dense_config(folder: Path) -> DenseConfig:
    config = _read_json(folder / "config.json")
    if "in_features" not in config or "out_features" not in config:
        raise ValueError(f"{str(folder)!r}: a Dense module's config.json needs in_features and out_features")
    return DenseConfig(folder=folder, in_features=config["in_features"], out_features=config["out_features"],
                       bias=config.get("bias", True), activation=config.get("activation_function", _DEFAULT_ACTIVATION),
                       use_residual=config.get("use_residual", False))


def read_st_folder(folder: Path, classifier: bool = False) -> STFolder:
    """The folder's sentence-transformers configuration (the defaults for a plain HF folder).

    ``classifier``: a cross-encoder / classifier checkpoint, whose head pools for itself: only
    its length limit and prompts are read, not its modules."""
    st_config = _read_json(folder / "config_sentence_transformers.json")
    prompts = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()}
    default_prompt_name = st_config.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise ValueError(f"{str(folder)!r}: default_prompt_name {default_prompt_name!r} is not one of its prompts")
    if classifier or not (folder / "modules.json").is_file():
        bert_config = _read_json(folder / "sentence_bert_config.json")
        return STFolder(model_folder=folder, pooling=PoolingConfig(modes=("cls",)), normalize=not classifier,
                        max_seq_length=bert_config.get("max_seq_length"),
                        do_lower_case=bool(bert_config.get("do_lower_case", False)),
                        prompts=prompts, default_prompt_name=default_prompt_name, is_sentence_transformers=False)
    model_folder, pooling, dense, normalize = None, None, [], False
    bert_config: dict = {}
    for module in json.loads((folder / "modules.json").read_text()):
        kind, path = _short_type(module["type"]), folder / module.get("path", "")
        if kind == "Transformer" and model_folder is None:
            model_folder, bert_config = path, _read_json(path / "sentence_bert_config.json")
        elif kind == "Pooling" and pooling is None:
            pooling = pooling_config(_read_json(path / "config.json"))
        elif kind == "Dense" and pooling is not None and not normalize:
            dense.append(_dense_config(path))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Dropout":  # dropout does nothing at inference
            raise ValueError(f"{str(folder)!r}: sentence-transformers module {module['type']!r} is not supported "
                             "here, or not in this place (supported: one Transformer, one Pooling, then Dense, Dropout, "
                             "and a last Normalize)")
    if model_folder is None or pooling is None:
        raise ValueError(f"{str(folder)!r}: modules.json must list a Transformer module and then a Pooling module")
    return STFolder(model_folder=model_folder, pooling=pooling, dense=tuple(dense), normalize=normalize,
                    max_seq_length=bert_config.get("max_seq_length"),
                    do_lower_case=bool(bert_config.get("do_lower_case", False)),
                    prompts=prompts, default_prompt_name=default_prompt_name)
