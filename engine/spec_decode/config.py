"""`speculative_config`, in vLLM's shape: `{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": .., "prompt_lookup_max": ..}` or `{"method": "suffix", ...}` with vLLM's
`suffix_decoding_*` keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from pagefleet.engine.errors import InvalidParameterError

_DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"},
    "suffix": {
        "method",
        "num_speculative_tokens",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
        "disable_by_batch_size",
    },
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Model-free speculation, at most `num_speculative_tokens` drafts a step; the engine's
    load switch verifies fewer (or none) when that is faster (spec_decode/load_switch.py).

    - `ngram` (vLLM's prompt lookup): the tokens that followed an earlier occurrence of the
      sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in
      its own prompt and output (spec_decode/ngram.py).
    - `suffix` (vLLM's suffix decoding): the most frequent continuation of the longest
      match (up to `suffix_decoding_max_tree_depth` tokens) in its own tokens and in the
      outputs of the last `suffix_decoding_max_cached_requests` requests, token by token
      while its share is at least `suffix_decoding_min_token_prob`, at most
      `suffix_decoding_max_spec_factor` times the match (spec_decode/suffix.py).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    disable_by_batch_size: int | None = None  # vLLM's fixed switch, on top of the measured one
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def parse(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict; raises InvalidParameterError naming what is wrong."""

        def fail(message: str) -> InvalidParameterError:
            return InvalidParameterError("speculative_config", message)

        if not isinstance(value, dict):
            raise fail(f"must be an object such as {{'method': 'ngram', 'num_speculative_tokens': 4}}, got {value!r}")
        method = value.get("method", "ngram")
        if method == "[ngram]":
            method = "ngram"
        if method not in _KEYS:
            raise fail(f"method must be 'ngram' or 'suffix' (speculation without a draft model); got {method!r}")
        unknown = sorted(set(value) - _KEYS[method])
        if unknown:
            raise fail(f"unknown keys {unknown} for method {method!r}")
        disable = value.get("disable_by_batch_size")
        if disable is not None and (not _is_int(disable) or disable < 2):
            raise fail(f"disable_by_batch_size must be an integer >= 2, got {disable!r}")
        if method == "suffix":
            return cls._parse_suffix(value, disable, fail)
        tokens = value.get("num_speculative_tokens")
        if not _is_int(tokens) or tokens < 1:
            raise fail(f"num_speculative_tokens must be an integer >= 1, got {tokens!r}")
        given_low, given_high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if given_low is None and given_high is None:
            given_low = given_high = _DEFAULT_LOOKUP
        bounds = []
        for name, bound in (("prompt_lookup_min", given_low), ("prompt_lookup_max", given_high)):
            bound = given_high if bound is None else bound  # one bound given: both are it
            bound = given_low if bound is None else bound
            if not _is_int(bound) or bound < 1:
                raise fail(f"{name} must be an integer >= 1, got {bound!r}")
            bounds.append(bound)
        low, high = bounds
        if low > high:
            raise fail(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        return cls(method, tokens, low, high, disable)

    @classmethod
    def _parse_suffix(
        cls, value: dict[str, Any], disable: int | None, fail: Callable[[str], InvalidParameterError]
    ) -> SpeculativeConfig:
        depth = value.get("suffix_decoding_max_tree_depth", 24)
        tokens = value.get("num_speculative_tokens", depth)  # vLLM: the depth bounds the drafts
        cached = value.get("suffix_decoding_max_cached_requests", 10000)
        factor = value.get("suffix_decoding_max_spec_factor", 1.0)
        probability = value.get("suffix_decoding_min_token_prob", 0.1)
        for name, number, least in (
            ("suffix_decoding_max_tree_depth", depth, 1),
            ("num_speculative_tokens", tokens, 1),
            ("suffix_decoding_max_cached_requests", cached, 0),
        ):
            if not _is_int(number) or number < least:
                raise fail(f"{name} must be an integer >= {least}, got {number!r}")
        if not _is_number(factor) or factor < 0:
            raise fail(f"suffix_decoding_max_spec_factor must be >= 0, got {factor!r}")
        if not _is_number(probability) or not 0 <= probability <= 1:
            raise fail(f"suffix_decoding_min_token_prob must be in [0, 1], got {probability!r}")
        return cls(
            "suffix",
            tokens,
            disable_by_batch_size=disable,
            suffix_decoding_max_tree_depth=depth,
            suffix_decoding_max_cached_requests=cached,
            suffix_decoding_max_spec_factor=float(factor),
            suffix_decoding_min_token_prob=float(probability),
        )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
