"""Structured outputs: text constrained to a JSON schema, any JSON object, a regex, one of
a few choices, or an EBNF grammar, as vLLM's `StructuredOutputsParams` asks for.

xgrammar does the grammar work (measured against llguidance on SmolLM2's 49k-token
vocabulary: 3 us per token to compute the allowed-token mask against 45 us; see
docs/engine.md). Each distinct constraint compiles once (cached, thread-safe) and before
its request enters the engine's lock, so a large schema never stalls the step loop. Each
sequence then carries its own matcher: the sampler masks its row with the matcher's
bitmask, and the matcher advances with every token the sequence takes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pagefleet.engine.errors import InvalidParameterError

_CACHE_SIZE = 256  # distinct constraints kept compiled
_MAX_WHITESPACE = 8  # longest run of free whitespace inside JSON (a small model may loop on it)


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or a string), `json_object` (any
    JSON object), `regex`, `choice` (one of these strings), `grammar` (EBNF, as
    xgrammar/GBNF write it). `disable_any_whitespace` makes JSON compact.

    Raises:
        InvalidParameterError: naming `structured_outputs` when not exactly one is given.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise InvalidParameterError(
                "structured_outputs",
                f"give exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}",
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or any(not isinstance(c, str) for c in self.choice)
        ):
            raise InvalidParameterError("structured_outputs", "choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidParameterError("structured_outputs", f"{name} must be a string")

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (equal constraints share one)."""
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, name)
            if value:
                text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
                return name, text, self.disable_any_whitespace
        return "json_object", "", self.disable_any_whitespace


class GrammarCompiler:
    """Compiles constraints for one tokenizer, each distinct one once (LRU cache)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached). Raises InvalidParameterError naming what is wrong
        with a schema, regex or grammar that cannot be compiled."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._compiler
        any_whitespace = not params.disable_any_whitespace
        try:
            if params.json or params.json_object:
                schema = params.json or '{"type": "object"}'
                return compiler.compile_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema),
                    any_whitespace=any_whitespace,
                    max_whitespace_cnt=_MAX_WHITESPACE,
                    strict_mode=not params.json_object,
                )
            if params.regex:
                return compiler.compile_regex(params.regex)
            if params.choice:
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(str(params.grammar))
        except Exception as error:  # xgrammar raises RuntimeError/ValueError with the reason
            kind = params.key()[0]
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InvalidParameterError(
                "structured_outputs", f"the {kind} constraint does not compile: {reason}"
            ) from error

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher: one per sequence. It ends at the model's stop tokens; a model
        without any ends where the constraint is complete."""
        if not self.stop_token_ids:
            return self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)


def allowed_tokens(matcher: Any, vocab_size: int) -> torch.Tensor:
    """The tokens `matcher` allows next, as xgrammar's packed bitmask (int32 words, bit b of
    word w is token 32w + b) for a vocabulary of `vocab_size` (the logits' width)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def apply_allowed_tokens(logits: torch.Tensor, allowed: list[torch.Tensor | None]) -> torch.Tensor:
    """Logits with every token a row's bitmask (allowed_tokens) leaves out set to -inf (rows
    without one untouched; the tensor is copied only if some row has one)."""
    rows = [i for i, mask in enumerate(allowed) if mask is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = torch.stack([allowed[i] for i in rows])  # type: ignore[misc]
    bits = torch.arange(32, dtype=torch.int32)
    keep = ((words.unsqueeze(-1) >> bits) & 1).bool().view(len(rows), -1)[:, :vocab]
    logits = logits.clone()
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    return logits
