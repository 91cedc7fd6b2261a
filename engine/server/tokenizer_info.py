"""`GET /tokenizer_info`: this replica's tokenizer and chat template (protocol/tokenizer_info.py),
for routers that hash prompts before they route them."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from fastapi import FastAPI, Response

from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.protocol.block_hash import VERSION
from pagefleet.protocol.tokenizer_info import TokenizerInfo


@lru_cache(maxsize=1)
def _describe(tokenizer: Any, model: str, block_size: int, long_rope_after: int | None = None) -> bytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise OpenAIError(501, "this model's tokenizer is not a fast tokenizer: routers cannot hash its prompts")
    info = TokenizerInfo(
        model=model,
        tokenizer_class=type(tokenizer).__name__,
        tokenizer_json=backend.to_str(),
        chat_template=getattr(tokenizer, "chat_template", None),
        special_tokens=dict(tokenizer.special_tokens_map),
        block_size=block_size,
        hash_version=VERSION.decode(),
        long_rope_after=long_rope_after,
    )
    return info.model_dump_json().encode()


def add_tokenizer_route(app: FastAPI, model: str, ready_engine: Callable[[], AsyncEngine]) -> None:
    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        engine = ready_engine()
        if engine.tokenizer is None:
            raise OpenAIError(501, "this replica runs without a tokenizer (skip_tokenizer_init)")
        body = _describe(engine.tokenizer, model, engine.stats().block_size, engine.long_rope_after)
        return Response(body, media_type="application/json")
