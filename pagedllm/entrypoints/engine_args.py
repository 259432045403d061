"""The engine's command-line flags, generated from the config dataclasses.

As vLLM's ``EngineArgs.add_cli_args`` does: every field of ``EngineConfig``
and of its ``CacheConfig``, ``LoRAConfig`` and ``PoolingConfig`` becomes ``--field-name`` with the field's help text,
so adding an engine option is adding one field in ``pagedllm/config/engine.py``, and
every command that builds an engine takes all of them.
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Callable
from dataclasses import MISSING, Field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pagedllm.config.engine import NESTED_CONFIGS, CacheConfig, EngineConfig, engine_option_fields
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.multimodal import MultiModalConfig
from pagedllm.config.pooling import PoolingConfig
from pagedllm.entrypoints.llm import LLM


def flag_of(option: str) -> str:
    return "--" + option.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine option: ``--x/--no-x`` for a boolean, the allowed
    words as choices for a ``Literal``, a typed value otherwise."""
    for title, config_class in (("engine", EngineConfig), ("KV cache", CacheConfig), ("LoRA", LoRAConfig),
                                 ("pooling", PoolingConfig), ("multimodal", MultiModalConfig)):
        group = parser.add_argument_group(title)
        annotations = get_type_hints(config_class)
        for option in fields(config_class):
            if option.name in NESTED_CONFIGS:
                continue
            action = group.add_argument(flag_of(option.name), **_argument_spec(option, annotations[option.name]))
            # Some Pythons' BooleanOptionalAction append the default to the help themselves.
            if action.default is not None and "%(default)" not in action.help:
                action.help += " (default: %(default)s)"


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM(...)`` keywords the engine flags of ``args`` stand for."""
    return {name: getattr(args, name) for name in engine_option_fields()}


def make_llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    """The engine the flags describe; ``overrides`` replace options (a bench's baseline)."""
    return LLM(**{**engine_options_from_args(args), **overrides})


def engine_flags_from_args(args: argparse.Namespace) -> list[str]:
    """The flags that give another command (a child ``pagedllm serve``) the
    engine options of ``args``; options left at their default are omitted."""
    flags: list[str] = []
    for name, option in engine_option_fields().items():
        value = getattr(args, name)
        if value == option.default:
            continue
        if isinstance(value, bool):
            flags.append(flag_of(name) if value else flag_of(f"no_{name}"))
        else:
            flags += [flag_of(name), json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def _argument_spec(option: Field, annotation: Any) -> dict[str, Any]:
    if option.default is MISSING:
        raise TypeError(f"engine option {option.name} needs a default to have a flag")
    if "help" not in option.metadata:
        raise TypeError(f"engine option {option.name} needs metadata={{'help': ...}} for its flag")
    help_text = option.metadata["help"].replace("%", "%%")  # argparse %-formats help texts
    spec: dict[str, Any] = {"default": option.default, "help": help_text}
    if annotation is bool:
        spec["action"] = argparse.BooleanOptionalAction
        return spec
    words, kinds = _split_annotation(annotation)
    if kinds == [dict]:
        spec["type"] = _json_object
    elif not words and len(kinds) == 1:
        spec["type"] = kinds[0]
    else:
        spec["type"] = _parser_of(words, kinds)
        spec["metavar"] = "{" + ",".join([*words, *(kind.__name__ for kind in kinds)]) + "}"
    return spec


def _split_annotation(annotation: Any) -> tuple[list[str], list[type]]:
    """The ``Literal`` words and the plain types (int, float, str) a value may be;
    ``None`` is left out, being the default of every optional option."""
    is_union = get_origin(annotation) in (Union, types.UnionType)
    members = get_args(annotation) if is_union else (annotation,)
    words: list[str] = []
    kinds: list[type] = []
    for member in members:
        if get_origin(member) is Literal:
            words += get_args(member)
        elif member is not type(None):
            kinds.append(member)
    return words, kinds


def _parser_of(words: list[str], kinds: list[type]) -> Callable[[str], Any]:
    """A flag value: one of ``words`` as it is, else the first of ``kinds`` that parses it."""

    def parse(text: str) -> Any:
        if text in words:
            return text
        for kind in kinds:
            try:
                return kind(text)
            except ValueError:
                continue
        expected = ", ".join([*words, *(kind.__name__ for kind in kinds)])
        raise argparse.ArgumentTypeError(f"expected one of: {expected}; got {text!r}")

    return parse


def _json_object(text: str) -> dict:
    """A flag whose value is a JSON object (vLLM's ``--speculative-config``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
