"""How KV moves between replicas, and its one transport today: a pull over HTTP.

A transport says how a decode replica reaches a prefill replica (`transfer_params`, put in
the prefill response in vLLM's shape) and fetches a prompt's KV from it (`pull`). The
engine never sees the network: its prefill-decode connector (engine/kv_connector) pins
blocks on the prefill side and loads a `RemoteKV` on the decode side. A GPU transport
(NIXL, RDMA) would be another `KVTransport`.

The HTTP pull: `POST /kv/pull` on the prefill replica's server (engine/server/kv_transfer.py)
with the request id, the blocks wanted and the caller's `KVLayout`. The prefill side checks
the layout before sending any byte (409 with the difference otherwise), streams frames
(wire.py), and frees the blocks once the last frame is sent.
"""

from __future__ import annotations

import math
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from pagefleet.engine.core.kv_groups import needed_blocks
from pagefleet.engine.kv_transfer import wire
from pagefleet.engine.kv_transfer.params import KVLayout, KVTransferError, RemoteKV
from pagefleet.protocol.kv_transfer import BlockIds, RemotePrefill, prefill_answer

PULL_PATH = "/kv/pull"


class KVTransport(Protocol):
    def transfer_params(self, request_id: str, block_ids: BlockIds) -> dict[str, Any]:
        """What a decode replica needs to pull these blocks from this replica."""
        ...

    async def pull(self, remote: RemotePrefill, layout: KVLayout, token_ids: list[int]) -> RemoteKV:
        """The KV of all but the last of `token_ids` (the prompt) from the prefill replica,
        which then frees its blocks. The last token is computed here: its logits pick the
        first token.

        Raises:
            KVTransferError: unreachable, unknown or expired request, different layout or prompt.
        """
        ...


def tokens_to_pull(num_prompt_tokens: int, state_block_size: int = 0) -> int:
    """All but the last prompt token; for a model with state layers (`state_block_size`: its
    block size), the prompt's last block boundary before that token, where its state is kept."""
    last = num_prompt_tokens - 1
    return last // state_block_size * state_block_size if state_block_size else last


class HTTPTransport:
    """Pulls over HTTP from the prefill replica's server; `url` is this replica's own
    advertised URL (what decode replicas are told to pull from)."""

    def __init__(self, engine_id: str, url: str, timeout: float = 30.0) -> None:
        address = urlsplit(url)
        self.engine_id = engine_id
        self.host = address.hostname or "127.0.0.1"
        self.port = address.port or (443 if address.scheme == "https" else 80)
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def transfer_params(self, request_id: str, block_ids: BlockIds) -> dict[str, Any]:
        return prefill_answer(request_id, block_ids, self.engine_id, self.host, self.port)

    async def pull(self, remote: RemotePrefill, layout: KVLayout, token_ids: list[int]) -> RemoteKV:
        num_tokens = tokens_to_pull(len(token_ids), layout.block_size if layout.has_state else 0)
        needed = [len(blocks) for blocks in needed_blocks(layout.kv_groups, num_tokens, layout.block_size)]
        held = remote.group_block_ids
        if len(held) != len(needed) or any(len(ids) < n for ids, n in zip(held, needed, strict=False)):
            raise KVTransferError(
                f"the prefill replica {remote.engine_id} holds blocks {[len(ids) for ids in held]} per KV cache "
                f"group; a prompt of {len(token_ids)} tokens needs {needed}"
            )
        asked = [ids[:n] for ids, n in zip(held, needed, strict=True)]
        body = {
            "request_id": remote.request_id,
            "block_ids": asked[0] if len(asked) == 1 else asked,
            "layout": layout.as_dict(),
        }
        url = f"http://{remote.host}:{remote.port}{PULL_PATH}"
        source = f"the prefill replica {remote.engine_id}"
        try:
            frames = await post_for_frames(self.client(), url, body)
        except PullRefusedError as error:
            raise KVTransferError(f"{source} refused the pull: {error.reason}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise KVTransferError(f"cannot pull from {source} at {url}: {error!r}") from None
        except ValueError as error:
            raise KVTransferError(f"{source} sent a broken stream: {error}") from None
        return assemble(frames, layout, token_ids[:num_tokens], source)

    def client(self) -> aiohttp.ClientSession:
        """This replica's HTTP session for KV transfers (pulls from prefill replicas and peers)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class PullRefusedError(KVTransferError):
    """The other replica answered, but not with KV (its status and its error's message)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


async def post_for_frames(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[tuple[dict[str, Any], bytes]]:
    """POST `body` and read the answer's frames (wire.py).

    Raises:
        PullRefusedError: an answer other than 200.
        aiohttp.ClientError, TimeoutError, OSError: the other replica cannot be reached.
        ValueError: the bytes are not frames.
    """
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise PullRefusedError(response.status, await _reason(response))
        reader = wire.FrameReader()
        frames: list[tuple[dict[str, Any], bytes]] = []
        async for chunk in response.content.iter_any():
            frames += reader.feed(chunk)
    return frames


async def _reason(response: aiohttp.ClientResponse) -> str:
    try:
        return str((await response.json())["error"]["message"])
    except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
        return f"HTTP {response.status}"


def assemble(
    frames: list[tuple[dict[str, Any], bytes]], layout: KVLayout, token_ids: list[int], source: str
) -> RemoteKV:
    """Check the frames against what was asked (the KV of `token_ids`: per layer, the blocks
    its KV cache group needs, `needed_blocks`) and stack them per layer."""
    if not frames or frames[0][0].get("kind") != "hello" or frames[-1][0].get("kind") != "end":
        raise KVTransferError(f"the KV stream from {source} was cut short")
    hello = frames[0][0]
    difference = layout.mismatch(KVLayout.from_dict(hello.get("layout", {})), "this decode replica", source)
    if difference:
        raise KVTransferError(f"{source} has a different KV layout: {difference}")
    if hello.get("token_ids", [])[: len(token_ids)] != token_ids:
        raise KVTransferError(f"{source} computed a different prompt")
    keys: list[Any] = [None] * layout.num_layers
    values: list[Any] = [None] * layout.num_layers
    state: list[list[Any]] = [[None, None] for _ in range(layout.num_state_layers)]
    num_blocks = math.ceil(len(token_ids) / layout.block_size)
    first_blocks = layout.first_blocks(len(token_ids))
    for header, payload in frames[1:-1]:
        tensor = wire.tensor_from(header, payload)
        layer = int(header["layer"])
        if header["kind"] in wire.STATE_KINDS:
            _place_state(state, layout, header["kind"], layer, tensor, source)
            continue
        if not 0 <= layer < layout.num_layers:
            raise KVTransferError(f"{source} sent layer {layer}")
        expected_shape = [num_blocks - first_blocks[layer], layout.block_size, *layout.layer_shape(layer)]
        if list(tensor.shape) != expected_shape or wire.DTYPE_NAMES[tensor.dtype] != layout.dtype:
            raise KVTransferError(f"{source} sent a tensor of shape {list(tensor.shape)} for layer {layer}")
        target = keys if header["kind"] == "key" else values
        target[layer] = tensor
    if any(t is None for t in keys + values) or any(t is None for pair in state for t in pair):
        raise KVTransferError(f"the KV stream from {source} missed layers")
    rows = [(conv, recurrent) for conv, recurrent in state] if layout.has_state else None
    return RemoteKV(len(token_ids), keys, values, first_blocks=first_blocks, state=rows)


def _place_state(state: list[list[Any]], layout: KVLayout, kind: str, layer: int, tensor: Any, source: str) -> None:
    """A state frame (wire.py) into `state[layer]`, checked against the layout's shapes."""
    which = wire.STATE_KINDS.index(kind)
    dtype = layout.dtype if which == 0 else "float32"
    if not 0 <= layer < layout.num_state_layers:
        raise KVTransferError(f"{source} sent state layer {layer}")
    if tuple(tensor.shape) != layout.state_shapes[which] or wire.DTYPE_NAMES[tensor.dtype] != dtype:
        raise KVTransferError(f"{source} sent a {kind} state of shape {list(tensor.shape)} for layer {layer}")
    state[layer][which] = tensor
