"""Suffix decoding (vLLM's `suffix`, after Arctic Inference's): drafts from the longest match
of a sequence's tail in its own prompt and output and in the outputs of recent requests,
continued while the continuation is frequent enough.

Where prompt lookup takes one earlier occurrence, this takes every occurrence of the
longest matching tail (up to `max_depth` tokens) in both places, and extends the draft one
token at a time with the continuation most of them share, while its share (the estimated
probability of that token) is at least `min_token_prob`. The draft is at most
`max_spec_factor` times the match's length, and match plus draft at most `max_depth`: a
long match earns a long draft. Agentic and structured workloads, which repeat what earlier
requests answered, are where this pays.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from pagefleet.engine.spec_decode.ngram import match_ends

_SEPARATOR = -1  # between cached outputs: no match or continuation crosses it


class RecentOutputs:
    """The outputs of the latest `max_requests` requests (at most `max_tokens` tokens in
    all), one after the other in one array with a separator after each, and where each
    token occurs in it: a lookup reads the occurrences of one token, never the whole array.
    Positions are counted from the first output ever added; evicted ones are skipped."""

    def __init__(self, max_requests: int, max_tokens: int = 1 << 20) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._lengths: deque[int] = deque()  # each live output's length, separator included
        self._buffer = np.empty(1024, dtype=np.int64)
        self._base = 0  # the position of _buffer[0]
        self._start = 0  # the first live position
        self._end = 0  # one past the last
        self._where: dict[int, list[int]] = {}  # token -> its positions, ascending

    def add(self, output: list[int]) -> None:
        if not self.max_requests or not output:
            return
        tokens = np.asarray([*output, _SEPARATOR], dtype=np.int64)
        self._reserve(len(tokens))
        at = self._end - self._base
        self._buffer[at : at + len(tokens)] = tokens
        for offset, token in enumerate(output):
            self._where.setdefault(token, []).append(self._end + offset)
        self._end += len(tokens)
        self._lengths.append(len(tokens))
        while len(self._lengths) > self.max_requests or self._end - self._start > self.max_tokens:
            self._start += self._lengths.popleft()

    def _reserve(self, count: int) -> None:
        """Room for `count` more tokens: drop the evicted part once it is most of the
        buffer (and the index entries pointing there), else grow."""
        if self._end - self._base + count <= len(self._buffer):
            return
        if self._start - self._base > len(self._buffer) // 2:
            self._buffer[: self._end - self._start] = self._buffer[self._start - self._base : self._end - self._base]
            self._base = self._start
            self._where = {t: kept for t, ps in self._where.items() if (kept := [p for p in ps if p >= self._start])}
        size = len(self._buffer)
        while self._end - self._base + count > size:
            size *= 2
        if size > len(self._buffer):
            grown = np.empty(size, dtype=np.int64)
            grown[: self._end - self._base] = self._buffer[: self._end - self._base]
            self._buffer = grown

    @property
    def corpus(self) -> np.ndarray:
        """The buffer, from its first kept position (index = position - `base`)."""
        return self._buffer[: self._end - self._base]

    @property
    def base(self) -> int:
        return self._base

    def ends(self, token: int) -> np.ndarray:
        """Indexes into `corpus` of `token`'s live occurrences."""
        positions = self._where.get(token)
        if not positions:
            return np.empty(0, dtype=np.int64)
        live = positions[bisect.bisect_left(positions, self._start) :]
        return np.asarray(live, dtype=np.int64) - self._base


def propose_suffix(
    token_ids: list[int],
    recent: RecentOutputs,
    num_tokens: int,
    max_depth: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> list[int]:
    """Up to `num_tokens` drafts after `token_ids` (see the module docstring). Of the match
    lengths worth trying (the longest, and shorter ones that leave the draft more of the
    depth), the one whose draft has the most expected accepted tokens wins."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    if len(tokens) < 2 or num_tokens < 1:
        return []
    tail = tokens[-max_depth:]
    sources = [(tokens, *match_ends(tokens, tail, max_depth))]
    ends = recent.ends(int(tail[-1]))
    if len(ends):
        sources.append((recent.corpus, *match_ends(recent.corpus, tail, max_depth, ends)))
    longest = max((int(matched.max()) for _, _, matched in sources if len(matched)), default=0)
    best: tuple[float, list[int]] = (0.0, [])
    for length in sorted({longest, min(longest, max_depth // 2), min(longest, max(1, max_depth // 4))}, reverse=True):
        room = min(num_tokens, int(max_spec_factor * length), max_depth - length)
        if length < 1 or room < 1:
            continue
        scored = _walk(_continuations(sources, length, room), min_token_prob)
        if scored[0] > best[0]:
            best = scored
    return best[1]


def _continuations(sources: list[tuple[np.ndarray, np.ndarray, np.ndarray]], length: int, room: int) -> np.ndarray:
    """The next `room` tokens after every match of at least `length` tokens (a separator, or
    the corpus's end, where they stop), one row each."""
    rows = []
    for corpus_tokens, ends, matched in sources:
        starts = ends[matched >= length] + 1
        index = starts[:, None] + np.arange(room)[None, :]
        past_end = index >= len(corpus_tokens)
        rows.append(np.where(past_end, _SEPARATOR, corpus_tokens[np.minimum(index, len(corpus_tokens) - 1)]))
    return np.concatenate(rows)


def _walk(continuations: np.ndarray, min_token_prob: float) -> tuple[float, list[int]]:
    """The draft that follows the most frequent continuation token by token while its
    share is at least `min_token_prob`, and its expected number of accepted tokens (the
    sum of the shares' running products)."""
    drafts: list[int] = []
    chance, expected = 1.0, 0.0
    for position in range(continuations.shape[1]):
        column = continuations[:, position]
        known = column[column != _SEPARATOR]
        if not len(known):
            break
        values, counts = np.unique(known, return_counts=True)
        best = int(counts.argmax())
        share = counts[best] / len(continuations)
        if share < min_token_prob:
            break
        drafts.append(int(values[best]))
        chance *= share
        expected += chance
        continuations = continuations[column == values[best]]
    return expected, drafts
