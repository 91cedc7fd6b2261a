"""The adapters a replica serves (multi-LoRA): named in `model` like any model.

They come from `--lora-modules name=path ...` at start-up and from vLLM's runtime routes,
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`. `/v1/models` lists each with `parent` set to
the base model, and the replica's Redis record lists them for the gateway.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagefleet.engine.errors import AdapterNotFoundError, InvalidParameterError
from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.server.errors import OpenAIError


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(modules: list[str | dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, path) of each --lora-modules entry, in either of vLLM's forms: `name=path`, or
    JSON `{"name": ..., "path": ..., "base_model_name": ...}` (the base is this replica's)."""
    pairs = []
    for module in modules:
        if isinstance(module, dict) or module.lstrip().startswith("{"):
            try:
                fields = module if isinstance(module, dict) else json.loads(module)
                name, path = fields["name"], fields["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules: expected {{"name": ..., "path": ...}}, got {module!r}') from None
        else:
            name, _, path = module.partition("=")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f"--lora-modules: expected name=path, got {module!r}")
        pairs.append((name, path))
    return pairs


class Adapters:
    """This replica's adapters by served name (the engine keeps their weights)."""

    def __init__(self, base_model_name: str) -> None:
        self.base_model_name = base_model_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def paths(self) -> dict[str, str]:
        return {name: request.lora_path for name, request in self.by_name.items()}

    def request_for(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model is not None else None

    async def load(self, engine: AsyncEngine, name: str, path: str) -> LoRARequest:
        """Read the adapter (off the event loop) and serve it under `name`.

        Raises:
            OpenAIError: 404 for a path with no adapter; 400 for LoRA off, a name already
                served or an adapter that cannot be served.
        """
        if name in self.by_name or name == self.base_model_name:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        request = LoRARequest(name, next(self._ids), path)
        try:
            await engine.add_lora(request)
        except AdapterNotFoundError as error:
            raise OpenAIError(404, str(error), "lora_path") from None
        except InvalidParameterError as error:
            raise OpenAIError(400, str(error), "lora_path") from None
        self.by_name[name] = request
        return request

    async def unload(self, engine: AsyncEngine, name: str) -> None:
        """Stop serving `name`: new requests for it get 404 at once; the engine forgets it
        between two steps (requests running with it finish).

        Raises:
            OpenAIError: 404 for an adapter this replica does not serve.
        """
        if self.by_name.pop(name, None) is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        await engine.remove_lora(name)

    def model_cards(self, created: int, max_model_len: int | None) -> list[dict[str, Any]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagefleet",
                "root": request.lora_path,
                "parent": self.base_model_name,
                "max_model_len": max_model_len,
            }
            for name, request in sorted(self.by_name.items())
        ]


def add_lora_routes(app: FastAPI, adapters: Adapters, engine_of: Any) -> None:
    """vLLM's runtime adapter routes; `engine_of()` is the loaded engine (or raises the 503)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        engine: AsyncEngine = engine_of()
        if not engine.serves_lora:
            raise OpenAIError(400, "LoRA is off on this replica: start it with --enable-lora", "lora_name")
        await adapters.load(engine, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await adapters.unload(engine_of(), body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
