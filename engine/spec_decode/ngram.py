"""Prompt lookup (vLLM's `ngram`): the tokens that followed an earlier occurrence of the
sequence's last n tokens are a cheap guess at its next ones. Extractive answers (quoting,
editing, rewriting the prompt) and repetitive structured output copy long runs this way."""

from __future__ import annotations

import numpy as np


def match_ends(
    corpus: np.ndarray, tail: np.ndarray, max_n: int, ends: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Positions in `corpus` where `tail`'s last token occurs with a token after it (or the
    given `ends`, known to hold it), and how many of `tail`'s last tokens (up to `max_n`)
    match backwards from each."""
    if ends is None:
        ends = np.flatnonzero(corpus[:-1] == tail[-1])
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, len(tail))):
        alive &= ends >= back
        alive[alive] &= corpus[ends[alive] - back] == tail[len(tail) - 1 - back]
        if not alive.any():
            break
        matched += alive
    return ends, matched


def propose_ngram(token_ids: list[int] | np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed an earlier occurrence of the longest suffix
    of `token_ids` of length `max_n` down to `min_n`; [] when none occurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if num_tokens < 1 or length < min_n + 1:
        return []
    ends, matched = match_ends(tokens, tokens, max_n)
    if not len(ends) or int(matched.max()) < min_n:
        return []
    best = ends[matched == matched.max()]
    # The latest occurrence with a whole continuation after it, else the earliest (a short
    # repeating cycle has its longest continuation there).
    full = best[best + 1 + num_tokens <= length]
    start = int(full[-1] if len(full) else best[0]) + 1
    return tokens[start : start + num_tokens].tolist()
