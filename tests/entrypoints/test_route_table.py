"""The route table (``common/routes.py``) is the server's: every path the app
registers is in it, and every path in it is registered (LoRA's with adapters)."""

from __future__ import annotations

from fastapi.routing import APIRoute

from pagedllm.entrypoints.openai.admin.lora import ServedAdapters
from pagedllm.entrypoints.openai.api_server import ServerState, build_app
from pagedllm.entrypoints.openai.common.routes import ROUTED_PATHS, ROUTES


def test_the_app_registers_exactly_the_table():
    state = ServerState(served_model_name="m", load_engine=lambda: None, adapters=ServedAdapters())
    registered = {route.path for route in build_app(state).routes if isinstance(route, APIRoute)}
    assert registered == {route.path for route in ROUTES}
    assert ROUTED_PATHS == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
