"""What a chat request's ``tool_choice`` means for the engine and the response.

- ``none`` (the default without tools): the tools are still rendered into the
  prompt (as vLLM does, so the model knows them, e.g. to talk about earlier
  calls), but the output is never parsed: it is all content.
- ``auto`` (the default with tools): the model decides; ``<tool_call>`` blocks in
  its output become ``tool_calls`` (Hermes format); with ``parallel_tool_calls``
  false only the first block is a call, the text after it stays content.
- ``required``: a grammar forces a non-empty JSON array of calls to the given
  tools (one call at most when ``parallel_tool_calls`` is false).
- a named function: a grammar forces that function's arguments object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallRecord
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.sampling_params import StructuredOutputsParams

# A function without a parameters schema takes an object (OpenAI's rule).
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """The constraint on the output (None: free text) and the parser of each choice's output."""

    structured_outputs: StructuredOutputsParams | None
    new_parser: Callable[[], ToolCallRecord] | None


def plan_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                     parallel_tool_calls: bool = True) -> ToolPlan:
    """``tools`` as OpenAI sends them (``{"type": "function", "function": {...}}``).
    Raises ``ValueError`` naming the field for a choice that cannot be honoured."""
    functions = {tool["function"]["name"]: tool["function"] for tool in tools or []}
    if len(functions) != len(tools or []):
        raise ValueError("tools: two tools have the same function name")
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan(None, None)
    if not functions:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools; pass tools or leave tool_choice out")
    if tool_choice == "auto":
        return ToolPlan(None, lambda: HermesToolParser(max_calls=None if parallel_tool_calls else 1))
    if tool_choice == "required":
        return ToolPlan(StructuredOutputsParams(json=_required_schema(functions, parallel_tool_calls)),
                        RequiredToolParser)
    name = tool_choice["function"]["name"]
    if name not in functions:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                         f"({', '.join(sorted(functions))})")
    schema = functions[name].get("parameters") or _ANY_OBJECT
    return ToolPlan(StructuredOutputsParams(json=schema), lambda: NamedToolParser(name))


def _required_schema(functions: dict[str, dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """vLLM's schema for ``required``: an array of calls, each one tool's name and its parameters."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": function.get("parameters") or _ANY_OBJECT},
              "required": ["name", "parameters"]}
             for name, function in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema
