"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding tokens one at a time is wrong for byte-level BPE (a character may span tokens) and
for tokenizers that drop leading spaces at a word start. We decode a short window of
tokens twice, with and without the newest ones, and emit the difference only once it no
longer ends in U+FFFD (an unfinished character).
"""

from __future__ import annotations

from typing import Any

from pagefleet.engine.core.request import Sequence

_CONTEXT_TOKENS = 5  # prompt tokens used as context for the first output tokens


class Detokenizer:
    """`tokenizer` None (an engine started with skip_tokenizer_init): no text at all."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(seq.read_offset - _CONTEXT_TOKENS, 0)

    def step(self, seq: Sequence, skip_special_tokens: bool) -> str:
        """New text made complete by the sequence's latest tokens (may be empty)."""
        if self.tokenizer is None:
            return ""
        ids = seq.token_ids
        prefix = self.tokenizer.decode(
            ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip_special_tokens
        )
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return full[len(prefix) :]

    def token_text(self, token_id: int) -> str:
        return "" if self.tokenizer is None else str(self.tokenizer.decode([token_id]))

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that appears in `text` overlapping its last `new_chars`
    characters, with its start index; None if there is none."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
