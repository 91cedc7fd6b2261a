"""The gateway's client for the replicas: keep-alive HTTP/1.1 on raw asyncio, parsed by
httptools (the C parser uvicorn uses).

It does only what the hot path needs: POST a body, read the status and headers, then the
body whole or piece by piece, and put the connection back for the next request. aiohttp
did the same at several times the CPU per request (bench/gateway_overhead.py).

A request is never sent twice (a replica may have started on it). So that a pooled
connection is not one the replica is closing just then, connections idle longer than
`max_idle_s` (below uvicorn's 5 s keep-alive) are dropped rather than reused. Reading stops while the client is slower
than the replica (`pause_reading` above `_HIGH_WATER` buffered bytes), so a slow client
never makes the gateway buffer a whole response.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20


@functools.lru_cache(maxsize=4096)
def replica_address(url: str) -> tuple[str, int]:
    """(host, port) of a replica's URL."""
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


class UpstreamError(ConnectionError):
    """The replica could not be reached, or broke the connection or the protocol."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.headers_done = asyncio.get_running_loop().create_future()
        self._wakeup: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response: {exc}"))
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(UpstreamError(f"the replica closed the connection{f': {exc}' if exc else ''}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._wake()

    def _fail(self, error: Exception) -> None:
        self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def next_chunk(self, timeout: float) -> bytes | None:
        """The next piece of the body, or None at its end."""
        while not self.chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self._wakeup = asyncio.get_running_loop().create_future()
            async with asyncio.timeout(timeout):
                await self._wakeup
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= _HIGH_WATER // 2:
            self.paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        return chunk


class UpstreamResponse:
    """A replica's answer: status and headers now, the body on demand. End it with
    `release()` once the body was read (the connection is reused) or `close()`."""

    def __init__(self, connection: _Connection, pool: UpstreamPool, address: tuple[str, int]) -> None:
        self._connection, self._pool, self._address = connection, pool, address
        self.status = connection.status
        self.raw_headers = connection.headers
        self._done = False

    def header(self, name: bytes) -> bytes:
        """The first value of a header (lower-case name), or b""."""
        return next((value for key, value in self.raw_headers if key.lower() == name), b"")

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._connection.next_chunk(self._pool.read_timeout)) is not None:
            yield chunk

    async def read(self) -> bytes:
        chunks = []
        while (chunk := await self._connection.next_chunk(self._pool.read_timeout)) is not None:
            chunks.append(chunk)
        return b"".join(chunks)

    def release(self) -> None:
        """Back to the pool if the body was read to its end and the replica keeps it open;
        closed otherwise."""
        if self._done:
            return
        self._done = True
        connection = self._connection
        if connection.complete and connection.keep_alive and not connection.closed and connection.error is None:
            self._pool.put(self._address, connection)
        else:
            connection.transport.close()  # type: ignore[union-attr]

    def close(self) -> None:
        """Drop the connection (the replica sees the request go away)."""
        if not self._done:
            self._done = True
            self._connection.transport.close()  # type: ignore[union-attr]


class UpstreamPool:
    """Idle keep-alive connections per replica address, newest first."""

    def __init__(
        self, connect_timeout: float, read_timeout: float, max_idle_per_replica: int = 64, max_idle_s: float = 4.0
    ) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_idle, self.max_idle_s = max_idle_per_replica, max_idle_s
        self._idle: dict[tuple[str, int], list[tuple[float, _Connection]]] = {}

    def put(self, address: tuple[str, int], connection: _Connection) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) < self.max_idle:
            idle.append((time.monotonic(), connection))
        else:
            connection.transport.close()  # type: ignore[union-attr]

    async def post(self, url: str, path: str, body: bytes, header_lines: bytes) -> UpstreamResponse:
        """Send the request (`header_lines`: `name: value\\r\\n` each) and wait for the
        response's status and headers."""
        return await self.send(b"POST", url, path, body, header_lines)

    async def send(self, method: bytes, url: str, path: str, body: bytes, header_lines: bytes) -> UpstreamResponse:
        """`post` with any method (`path` may carry a query string)."""
        address = replica_address(url)
        head = b"%s %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-length: %d\r\n" % (
            method,
            path.encode(),
            address[0].encode(),
            address[1],
            len(body),
        )
        request = b"".join((head, header_lines, b"\r\n", body))
        return await self._exchange(self._pooled(address) or await self._connect(address), request, address)

    def _pooled(self, address: tuple[str, int]) -> _Connection | None:
        """The most recently used idle connection that is open and fresh; the rest are closed
        (they are older)."""
        idle = self._idle.get(address)
        while idle:
            since, connection = idle.pop()
            if connection.closed:
                continue
            if time.monotonic() - since < self.max_idle_s:
                return connection
            connection.transport.close()  # type: ignore[union-attr]
            for _, older in idle:
                older.transport.close()  # type: ignore[union-attr]
            idle.clear()
        return None

    async def _connect(self, address: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(_Connection, *address)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {address[0]}:{address[1]}: {exc!r}") from exc
        return connection

    async def _exchange(self, connection: _Connection, request: bytes, address: tuple[str, int]) -> UpstreamResponse:
        connection._reset()
        connection.transport.write(request)  # type: ignore[union-attr]
        try:
            async with asyncio.timeout(self.read_timeout):
                await connection.headers_done
        except BaseException:
            connection.transport.close()  # type: ignore[union-attr]
            raise
        return UpstreamResponse(connection, self, address)

    def close(self) -> None:
        for idle in self._idle.values():
            for _, connection in idle:
                connection.transport.close()  # type: ignore[union-attr]
        self._idle.clear()
