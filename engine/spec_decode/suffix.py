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

from collections import deque

import numpy as np

from pagefleet.engine.spec_decode.ngram import match_ends

_SEPARATOR = -1  # between cached outputs: no match or continuation crosses it


class RecentOutputs:
    """The outputs of the latest `max_requests` requests (at most `max_tokens` tokens in
    all), in one array with a separator after each."""

    def __init__(self, max_requests: int, max_tokens: int = 1 << 20) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._outputs: deque[np.ndarray] = deque()
        self._num_tokens = 0
        self._corpus: np.ndarray | None = np.empty(0, dtype=np.int64)

    def add(self, output: list[int]) -> None:
        if not self.max_requests or not output:
            return
        self._outputs.append(np.asarray([*output, _SEPARATOR], dtype=np.int64))
        self._num_tokens += len(output) + 1
        while len(self._outputs) > self.max_requests or self._num_tokens > self.max_tokens:
            self._num_tokens -= len(self._outputs.popleft())
        self._corpus = None  # joined again when next read

    @property
    def corpus(self) -> np.ndarray:
        if self._corpus is None:
            self._corpus = np.concatenate(self._outputs) if self._outputs else np.empty(0, dtype=np.int64)
        return self._corpus


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
    corpus = recent.corpus
    if len(corpus) > 1:
        sources.append((corpus, *match_ends(corpus, tail, max_depth)))
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
        padded = np.concatenate([corpus_tokens, np.full(room, _SEPARATOR, dtype=np.int64)])
        rows.append(padded[index])
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
