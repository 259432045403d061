"""Turning a model's output text back into OpenAI ``tool_calls``."""

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolCallRecord
from pagedllm.entrypoints.openai.tool_parsers.choice import ToolPlan, plan_tool_choice
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser

__all__ = ["HermesToolParser", "NamedToolParser", "ParsedDelta", "RequiredToolParser", "ToolCallDelta",
           "ToolCallRecord", "ToolPlan", "plan_tool_choice"]
