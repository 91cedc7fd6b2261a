"""A request's prefix-cache block hashes, computed in the gateway exactly as the engine will
compute them, so routing can look them up in the fleet's index (prefix_index.py).

Per model, the tokenizer and chat template come from a replica's `GET /tokenizer_info`
(protocol/tokenizer_info.py), fetched once in the background; until it has arrived a request
has no hashes and is routed by load. Chat prompts are rendered by runtime/chat_prompt.py,
the engine's own renderer, and hashed by protocol/block_hash.py, the engine's own hash.

Speed: the tokenizer splits text at its added tokens (`<|im_start|>` and the like) before
anything else, so the pieces between them are tokenized independently of each other. The
gateway does the same split and remembers each piece's token ids: a system prompt or an
earlier turn that comes again costs a dictionary lookup, and only the new text is tokenized.
This is exact only while no added token strips the spaces around it or must stand alone as
a word; for such a tokenizer every prompt is tokenized whole.

Text never seen before goes one level further for byte-level BPE tokenizers (GPT-2's,
SmolLM2's, with nothing before the split): they cut text into words with GPT-2's pattern and
tokenize each word on its own, so the gateway cuts it the same way and remembers each word's
ids. A 1,000-token prompt of words seen before then costs the split and a lookup per word,
about a quarter of what `tokenizers` itself takes for it (bench/gateway_overhead.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import httpx
import numpy
import regex
from pydantic import ValidationError
from tokenizers import Tokenizer

from pagefleet.gateway.hash_runs import HashRuns
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.protocol.block_hash import VERSION, chain_root
from pagefleet.protocol.openai import ChatCompletionRequest
from pagefleet.protocol.tokenizer_info import TokenizerInfo
from pagefleet.runtime.chat_prompt import (
    ChatTemplateError,
    chat_messages,
    render_chat,
    template_takes_tools,
    template_tools,
)

logger = logging.getLogger(__name__)

_PIECES_CACHED = 4096  # distinct texts between added tokens remembered per model
_WORDS_CACHED = 100_000  # distinct words remembered per model (forgotten all at once beyond)
_LINKS_CACHED = 100_000  # block hashes remembered per model, by their input (about 20 MB)
_FETCH_RETRY_S = 5.0
# GPT-2's split as `tokenizers`' ByteLevel pre-tokenizer applies it (Oniguruma's `\s` is
# Unicode's White_Space, which Python's `\s` is not quite).
_GPT2_WORDS = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+"
    r"|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+"
)
# The same for ASCII text, where it means the same; Python's own `re` is 3-4 times faster.
_GPT2_WORDS_ASCII = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+", re.ASCII
)


def _tokenizes_word_by_word(tokenizer_json: str) -> bool:
    """Whether the tokenizer is byte-level BPE that splits text with GPT-2's pattern first
    and changes nothing before: then each word's tokens depend on that word alone."""
    spec = json.loads(tokenizer_json)
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and model.get("type") == "BPE"
        and not model.get("dropout")
    )


class PromptHasher:
    """One model's tokenizer, chat template and block size, as its replicas have them."""

    def __init__(self, info: TokenizerInfo) -> None:
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self.chat_template, self.special_tokens = info.chat_template, info.special_tokens
        self.block_size, self.long_rope_after = info.block_size, info.long_rope_after
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.takes_tools = template_takes_tools(info.chat_template)
        added = self.tokenizer.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        splittable = all(not (t.lstrip or t.rstrip or t.single_word) for t in added.values())
        contents = sorted(self._added_ids, key=len, reverse=True)
        self._splitter = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if splittable and contents else None
        self._prefix_ids = self.tokenizer.encode("", add_special_tokens=True).ids  # e.g. a BOS token
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._words: dict[str, tuple[int, ...]] | None = {} if _tokenizes_word_by_word(info.tokenizer_json) else None
        self._links: dict[bytes, int] = {}  # block_hash.block_hashes' `known`
        self._runs = HashRuns()

    def token_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text` tokenized as the engine's tokenizer does it."""
        if self._splitter is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        ids = list(self._prefix_ids) if add_special_tokens else []
        for index, piece in enumerate(self._splitter.split(text)):
            if index % 2:  # an added token
                ids.append(self._added_ids[piece])
            elif piece:
                ids += self._piece_ids(piece)
        return ids

    def _piece_ids(self, piece: str) -> list[int]:
        cached = self._pieces.get(piece)
        if cached is not None:
            self._pieces.move_to_end(piece)
            return cached
        if self._words is None:
            ids = self.tokenizer.encode(piece, add_special_tokens=False).ids
        else:
            ids = self._ids_word_by_word(piece, self._words)
        self._pieces[piece] = ids
        if len(self._pieces) > _PIECES_CACHED:
            self._pieces.popitem(last=False)
        return ids

    def _ids_word_by_word(self, piece: str, known: dict[str, tuple[int, ...]]) -> list[int]:
        words = (_GPT2_WORDS_ASCII if piece.isascii() else _GPT2_WORDS).findall(piece)
        try:
            return list(itertools.chain.from_iterable(map(known.__getitem__, words)))
        except KeyError:  # a word not seen before
            pass
        new = {word for word in words if word not in known}
        if len(known) + len(new) > _WORDS_CACHED:
            known.clear()
            new = set(words)
        if 2 * len(new) > len(words):  # mostly new: one call, and its words' ids learned from it
            encoding = self.tokenizer.encode(piece, add_special_tokens=False)
            ids = encoding.ids
            word_ids = numpy.asarray(encoding.word_ids, dtype=numpy.int64)  # no special tokens: never None
            word_ends = (numpy.flatnonzero(numpy.diff(word_ids)) + 1).tolist()
            if len(word_ends) == len(words) - 1:  # each word has its own tokens, as it should
                bounds = [0, *word_ends, len(ids)]
                # Tuples: a cache of many small lists would slow every garbage collection.
                known.update(zip(words, map(tuple, map(ids.__getitem__, map(slice, bounds, bounds[1:]))), strict=True))
            return ids
        if new:
            new_words = list(new)
            encoded = self.tokenizer.encode_batch_fast(new_words, add_special_tokens=False)
            known.update(zip(new_words, (tuple(encoding.ids) for encoding in encoded), strict=True))
        return list(itertools.chain.from_iterable(map(known.__getitem__, words)))

    def prompt_token_ids(self, payload: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids (the first prompt of a batch), or None when the body is
        not one the engine would take (the replica will say why)."""
        if chat:
            if not self.chat_template:
                return None
            try:
                body = ChatCompletionRequest.model_validate(payload)
                messages = chat_messages(body, self.takes_tools)
                tools = template_tools(body, self.takes_tools)
                text = render_chat(
                    self.chat_template,
                    messages,
                    self.special_tokens,
                    body.add_generation_prompt,
                    tools,
                    body.continue_final_message,
                )
            except (ValidationError, ChatTemplateError):
                return None
            return self.token_ids(text, add_special_tokens=False)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt decides
        if isinstance(prompt, str):
            return self.token_ids(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            return prompt
        return None

    def hashes(self, payload: dict[str, Any], chat: bool, adapter: str | None) -> tuple[int, list[int]] | None:
        """The prompt's length in tokens and the hashes of the blocks the engine could take
        from its prefix cache for it: every full block before the last token (whose logits
        the engine computes in any case), as the engine registers them (a LongRoPE model's
        prompt past its pretraining length from the long-rope root, as the engine's)."""
        token_ids = self.prompt_token_ids(payload, chat)
        keep = payload.get("truncate_prompt_tokens")
        if token_ids and isinstance(keep, int) and keep > 0:
            token_ids = token_ids[-keep:]  # as the engine truncates (-1, to the context window, is rare)
        if not token_ids:
            return None
        salt = payload.get("cache_salt")
        long_rope = self.long_rope_after is not None and len(token_ids) > self.long_rope_after
        root = chain_root(adapter, salt if isinstance(salt, str) and salt else None, long_rope)
        if len(self._links) > _LINKS_CACHED:
            self._links.clear()
        return len(token_ids), self._runs.hashes(token_ids[:-1], self.block_size, root, self._links)


class PromptHashers:
    """Each model's PromptHasher, fetched from one of its replicas in the background: as soon
    as the model has two replicas (`prefetch`), or when a request first needs it (that
    request is routed without)."""

    def __init__(self, on_ready: Callable[[str], None] | None = None, timeout_s: float = 10.0) -> None:
        self.on_ready = on_ready  # told each model whose hasher has arrived
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self._hashers: dict[str, PromptHasher] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}

    def try_get(self, model: str, replica_url: str) -> PromptHasher | None:
        """The model's hasher, or None while it is being fetched from `replica_url`."""
        hasher = self._hashers.get(model)
        if hasher is not None or model in self._fetching:
            return hasher
        loop = asyncio.get_running_loop()
        if loop.time() - self._failed_at.get(model, -_FETCH_RETRY_S) < _FETCH_RETRY_S:
            return None
        task = loop.create_task(self._fetch(model, replica_url))
        self._fetching[model] = task
        task.add_done_callback(lambda _: self._fetching.pop(model, None))
        return None

    async def prefetch(self, registry: ReplicaRegistry, interval_s: float) -> None:
        """Until cancelled: fetch the hasher of every model with more than one replica."""
        while True:
            for model, records in list(registry.by_model.items()):
                if len(records) > 1:
                    self.try_get(model, records[0].url)
            await asyncio.sleep(interval_s)

    async def _fetch(self, model: str, replica_url: str) -> None:
        try:
            response = await self._client.get(f"{replica_url}/tokenizer_info")
            response.raise_for_status()
            info = TokenizerInfo.model_validate_json(response.content)
            if info.hash_version != VERSION.decode():
                raise ValueError(f"its replicas hash prefixes as {info.hash_version}, not {VERSION.decode()}")
            self._hashers[model] = await asyncio.to_thread(PromptHasher, info)
            logger.info("prefix-aware routing for %s: tokenizer read from %s", model, replica_url)
            if self.on_ready is not None:
                self.on_ready(model)
        except (httpx.HTTPError, ValidationError, ValueError) as error:
            self._failed_at[model] = asyncio.get_running_loop().time()
            logger.warning("cannot read %s's tokenizer from %s (%s); routing it by load", model, replica_url, error)

    async def close(self) -> None:
        for task in list(self._fetching.values()):
            task.cancel()
        await asyncio.gather(*self._fetching.values(), return_exceptions=True)
        await self._client.aclose()
