"""The file tier's on-disk format: one file per full KV block of one KV cache group, named
by its block hash (and its group, past the first), in a directory a model's replicas share
(node-local, or a ReadWriteMany volume).

A file is `PFKV`, a 4-byte header length, a JSON header, then the block's keys and values
for the layers of its group, layer by layer (keys then values, each [block_size, kv_heads,
head_dim] in the cache's dtype). Keyed by (group, block hash) as the prefix cache is, a
sliding-window group's files are read only for the last window before a prefix's end.
The header names what must agree before the bytes are used (`KVLayout`: model, layer
count, heads, head size, block size, dtype, KV cache groups), its group, the block's own token ids (the chain
hash names the prefix; the tokens guard against a collision, as the in-memory prefix cache
does) and a CRC-32 of the payload. A file is written under a temporary name and renamed,
so a reader never sees half of one; a file that is torn anyway, of another layout, of
other tokens or whose checksum fails is a miss, never used.

A model with state layers also stores, by the hash of the block it follows, the state a
sequence has after that block (a snapshot: each state layer's convolution window in the
cache's dtype, then its recurrent state in float32), in a file of the same format named
`<hash>-state.kv` with the block's tokens in its header; a prefix is stored as far as its
blocks are and the state after its last block is.

Each layout has its own sub-directory (`layout_folder`). Size: it is kept under
`max_bytes` by whichever writer finds it over: the files least recently used (a hit
refreshes a file's time) go first. Several processes may write and evict at once; a file
that vanishes under a reader is a miss.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.engine.core.kv_groups import group_layers, longest_prefix
from pagefleet.engine.kv_transfer.params import KVLayout, StateRows

logger = logging.getLogger(__name__)

MAGIC = b"PFKV"
FORMAT = 1
SUFFIX = ".kv"
STATE = -1  # the "group" of a state snapshot's file
_HEADER_LENGTH = struct.Struct("<I")


class UnusableBlockError(ValueError):
    """A block file that must not be used (a miss, never wrong output)."""


@dataclass(slots=True)
class StoredBlock:
    """One block read back: its keys and values per layer of its group, [block_size,
    kv_heads, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    num_bytes: int


def layout_folder(layout: KVLayout) -> str:
    """The sub-directory of one layout: replicas of other dtypes or block sizes may share the
    directory without ever reading each other's files (the hash names only the tokens)."""
    key = json.dumps(layout.as_dict(), sort_keys=True).encode()
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(layout.model).name)[:40]
    return f"{name}-{layout.dtype}-b{layout.block_size}-{zlib.crc32(key):08x}"


class FileStore:
    """Reads and writes blocks of one layout under `directory` (any thread; no state but
    the files and a running estimate of their size)."""

    def __init__(self, directory: str | Path, layout: KVLayout, max_bytes: int) -> None:
        self.directory = Path(directory) / layout_folder(layout)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.groups = layout.kv_groups
        self.max_bytes = max_bytes
        self._dtype = getattr(torch, layout.dtype)
        # Per group, each of its layers' block shape (Gemma 4's global layers have their own).
        self._shapes = [
            [(layout.block_size, *layout.layer_shape(layer)) for layer in group_layers(self.groups, group)]
            for group in range(self.groups.num_groups)
        ]
        element = torch.empty(0, dtype=self._dtype).element_size()
        self._block_bytes = [2 * element * sum(math.prod(shape) for shape in shapes) for shapes in self._shapes]
        self._state_shapes = [shape for _ in range(layout.num_state_layers) for shape in layout.state_shapes]
        self._state_dtypes = [self._dtype, torch.float32] * layout.num_state_layers
        state_parts = zip(self._state_shapes, self._state_dtypes, strict=True)
        self._state_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in state_parts)
        self._size_estimate: int | None = None  # of the whole directory, refreshed by scans

    def block_bytes(self, group: int = 0) -> int:
        """The payload of one block file of `group` (its layers' keys and values), or of a
        state snapshot's file (`STATE`)."""
        return self._state_bytes if group == STATE else self._block_bytes[group]

    def path(self, block_hash: int, group: int = 0) -> Path:
        suffix = {0: "", STATE: "-state"}.get(group, f"-g{group}")
        return self.directory / f"{block_hash:016x}{suffix}{SUFFIX}"

    def contains(self, block_hash: int, group: int = 0) -> bool:
        return self.path(block_hash, group).exists()

    def longest_prefix(self, hashes: list[int]) -> int:
        """How many blocks of the chain `hashes` every group has files for (the blocks each
        needs, `needed_blocks`): a cheap look before reading."""
        present: dict[tuple[int, int], bool] = {}

        def has(group: int, index: int) -> bool:
            if (group, index) not in present:
                present[group, index] = self.contains(hashes[index], group)
            return present[group, index]

        num_blocks = longest_prefix(self.groups, len(hashes), self.layout.block_size, has)
        if self.layout.has_state:  # and the state after its last block
            while num_blocks and not self.contains(hashes[num_blocks - 1], STATE):
                num_blocks -= 1
        return num_blocks

    # --- writing --------------------------------------------------------------------------

    def write(
        self,
        block_hash: int,
        token_ids: tuple[int, ...],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        group: int = 0,
    ) -> int:
        """Store one block of `group` (its layers' keys and values; a no-op if its file
        exists); the bytes written."""
        tensors = [tensor for pair in zip(keys, values, strict=True) for tensor in pair]
        return self._write(block_hash, token_ids, tensors, group)

    def write_state(self, block_hash: int, token_ids: tuple[int, ...], state: StateRows) -> int:
        """Store the state after the block of `block_hash` (whose tokens are `token_ids`)."""
        return self._write(block_hash, token_ids, [tensor for pair in state for tensor in pair], STATE)

    def _write(self, block_hash: int, token_ids: tuple[int, ...], tensors: list[torch.Tensor], group: int) -> int:
        target = self.path(block_hash, group)
        if target.exists():
            return 0
        payload = b"".join(tensor.contiguous().view(torch.uint8).numpy().tobytes() for tensor in tensors)
        header = json.dumps(
            {
                "format": FORMAT,
                "layout": self.layout.as_dict(),
                "hash": f"{block_hash:016x}",
                "group": group,
                "tokens": list(token_ids),
                "crc32": zlib.crc32(payload),
                "payload_bytes": len(payload),
            }
        ).encode()
        temporary = self.directory / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(MAGIC + _HEADER_LENGTH.pack(len(header)) + header + payload)
        os.replace(temporary, target)
        written = len(MAGIC) + _HEADER_LENGTH.size + len(header) + len(payload)
        self._grow(written)
        return written

    def _grow(self, written: int) -> None:
        if self._size_estimate is None:
            self._size_estimate = self.scan_size()
        self._size_estimate += written
        if self._size_estimate > self.max_bytes:
            self._size_estimate = self.evict(int(self.max_bytes * 0.9))

    def scan_size(self) -> int:
        return sum(entry.stat().st_size for entry in self._entries())

    def evict(self, target_bytes: int) -> int:
        """Delete least recently used files until the directory holds at most
        `target_bytes`; the size left."""
        files = []
        for entry in self._entries():
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # another writer evicted it
            files.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        evicted = 0
        for _, size, path in sorted(files):
            if total <= target_bytes:
                break
            try:
                os.unlink(path)
                evicted += 1
            except FileNotFoundError:
                pass
            total -= size
        if evicted:
            logger.info("kv file tier: evicted %d least recently used blocks (%d bytes left)", evicted, total)
        return total

    def _entries(self) -> list[os.DirEntry[str]]:
        with os.scandir(self.directory) as entries:
            return [entry for entry in entries if entry.name.endswith(SUFFIX) and not entry.name.startswith(".")]

    # --- reading --------------------------------------------------------------------------

    def read(self, block_hash: int, token_ids: tuple[int, ...], group: int = 0) -> StoredBlock | None:
        """The block of `group`, or None if it is absent.

        Raises:
            UnusableBlockError: the file is torn, corrupted, of another layout or of other
                tokens (it is removed, so that a writer may store a sound copy).
        """
        read = self._read(block_hash, token_ids, group)
        if read is None:
            return None
        payload, num_bytes = read
        flat = torch.frombuffer(payload, dtype=self._dtype)
        shapes = [shape for shape in self._shapes[group] for _ in ("key", "value")]
        pieces = flat.split([math.prod(shape) for shape in shapes])
        tensors = [piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)]
        return StoredBlock(list(tensors[0::2]), list(tensors[1::2]), num_bytes)

    def read_state(self, block_hash: int, token_ids: tuple[int, ...]) -> StateRows | None:
        """The state after the block of `block_hash`, or None if absent (raises as `read`)."""
        read = self._read(block_hash, token_ids, STATE)
        if read is None:
            return None
        payload, offset, tensors = read[0], 0, []
        for shape, dtype in zip(self._state_shapes, self._state_dtypes, strict=True):
            size = math.prod(shape) * dtype.itemsize
            tensors.append(torch.frombuffer(payload[offset : offset + size], dtype=dtype).view(shape))
            offset += size
        return list(zip(tensors[0::2], tensors[1::2], strict=True))

    def _read(self, block_hash: int, token_ids: tuple[int, ...], group: int) -> tuple[bytearray, int] | None:
        """A file's checked payload and its size on disk, or None if it is absent."""
        path = self.path(block_hash, group)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        problem = self._check(data, block_hash, token_ids, group)
        if isinstance(problem, str):
            logger.warning("kv file tier: %s is not used, and removed: %s", path.name, problem)
            path.unlink(missing_ok=True)
            raise UnusableBlockError(problem)
        try:
            now = time.time()
            os.utime(path, (now, now))  # recently used: evicted last
        except FileNotFoundError:
            pass
        return bytearray(memoryview(data)[problem:]), len(data)

    def _check(self, data: bytes, block_hash: int, token_ids: tuple[int, ...], group: int) -> int | str:
        """The payload's offset, or why the file cannot be used."""
        start = len(MAGIC) + _HEADER_LENGTH.size
        if len(data) < start or data[: len(MAGIC)] != MAGIC:
            return "not a block file"
        (header_length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
        try:
            header = json.loads(data[start : start + header_length])
            layout = KVLayout.from_dict(header["layout"])
        except (ValueError, KeyError, TypeError, RuntimeError):
            return "unreadable header (torn file?)"
        if header.get("format") != FORMAT:
            return f"format {header.get('format')}, this engine reads {FORMAT}"
        mismatch = self.layout.mismatch(layout, "this replica", "the file")
        if mismatch:
            return mismatch
        if header.get("group", 0) != group:
            return f"a block of group {header.get('group')}, not {group}"
        if header.get("hash") != f"{block_hash:016x}" or tuple(header.get("tokens", ())) != token_ids:
            return "other tokens under this hash"
        payload = memoryview(data)[start + header_length :]
        if len(payload) != header.get("payload_bytes") or len(payload) != self.block_bytes(group):
            return f"{len(payload)} payload bytes, expected {self.block_bytes(group)} (torn file?)"
        if zlib.crc32(payload) != header.get("crc32"):
            return "checksum mismatch"
        return start + header_length
