"""A server's stored responses (the Responses API): its store, shared through Redis or its
own, and the background responses this replica runs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagefleet.engine.server.errors import OpenAIError
from pagefleet.runtime.response_store import ResponseStore, StoredResponse, StoreUnavailable


@dataclass(slots=True)
class StoredResponses:
    """This server's stored responses: the store, and the background responses it runs."""

    store: ResponseStore
    own_url: str
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def record(self, response_id: str) -> StoredResponse:
        """The stored response; OpenAIError 404 if there is none, 503 if the store is down."""
        try:
            record = await self.store.get(response_id)
        except StoreUnavailable as error:
            raise unavailable(error) from error
        if record is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return record

    async def save(self, record: StoredResponse, replace_only: bool = False) -> None:
        try:
            await self.store.put(record, replace_only)
        except StoreUnavailable as error:
            raise unavailable(error) from error

    async def delete(self, response_id: str) -> None:
        """Forget a stored response (OpenAIError 404 if there is none); if this replica runs
        it in the background, the run stops: nothing is left to write its answer to."""
        try:
            deleted = await self.store.delete(response_id)
        except StoreUnavailable as error:
            raise unavailable(error) from error
        if not deleted:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", "response_id")
        task = self.running.get(response_id)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        for task in self.running.values():
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        await self.store.close()


def unavailable(error: StoreUnavailable) -> OpenAIError:
    return OpenAIError(503, f"The response store is unavailable: {error}", headers={"Retry-After": "1"})
