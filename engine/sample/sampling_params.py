"""Per-request sampling settings, validated once when the request is created."""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.sample.structured_outputs import StructuredOutputsParams

# Seeds are 64-bit, as torch's generators (and vLLM's limits) take them.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# |length_penalty| <= 50 keeps len ** length_penalty a finite float64 for any length up to
# 2**20 tokens (transformers' formula overflows, and raises, beyond that).
MAX_ABS_LENGTH_PENALTY = 50.0
_FLOAT_FIELDS = (
    "length_penalty",
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# Sampling fields beam search must leave alone (temperature is ignored: beams rank by logprob).
_SAMPLING_DEFAULTS: dict[str, object] = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "stop": [],
}


class RequestOutputKind(enum.IntEnum):
    """What each output of a request carries (vLLM's names and values)."""

    CUMULATIVE = 0  # everything generated so far, after every step that changed it
    DELTA = 1  # only what is new since the previous output; outputs with nothing new are left out
    FINAL_ONLY = 2  # one output, when the request ends


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Defaults follow vLLM: `max_tokens=16`, `temperature=1.0`, no top-k/top-p/min-p
    filtering. `temperature=0` means greedy. `top_k <= 0` disables top-k.

    `best_of` sequences are generated and the `n` with the highest cumulative logprob
    returned. With `use_beam_search`, `beam_width` beams are searched (ranked like
    transformers: cumulative logprob / generated length ** `length_penalty`;
    `early_stopping` is True, False or "never") and the `n` best finished beams returned;
    beam search is deterministic, so the sampling fields must keep their defaults.

    Token constraints, applied before choosing (logprobs stay those of the raw
    distribution): `logit_bias` adds to chosen tokens' logits; `allowed_token_ids` keeps
    only those tokens; `bad_words` are never completed (each word's last token is banned
    where the output ends with the rest of it, with and without a leading space, as vLLM).
    `truncate_prompt_tokens` keeps only the prompt's last k tokens (-1: as many as the
    context window holds). `spaces_between_special_tokens` is accepted for vLLM's sake;
    the fast tokenizers used here always decode special tokens without added spaces.

    `structured_outputs` constrains the text to a JSON schema, a regex, a choice or a
    grammar (`StructuredOutputsParams`, or a dict of its fields).

    `output_kind` (vLLM's `RequestOutputKind`): cumulative outputs after every step, deltas,
    or the final output only (what `LLM.generate` asks for). Beam search, and best_of > n,
    whose results are ranked only at the end, send whole results in DELTA mode: the running
    beams' cumulative ones, and the chosen samples at the end.

    Raises:
        InvalidParameterError: (a ValueError) naming the first invalid field.
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Free-form arguments for extensions, as vLLM's; `kv_transfer_params` (prefill/decode
    # disaggregation, see engine/kv_transfer) is read from here.
    extra_args: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Token ids of `bad_words`, filled in by the engine from its tokenizer (as vLLM's).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            kind = self.output_kind
            raise InvalidParameterError("output_kind", f"must be a RequestOutputKind, got {kind!r}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as error:
                raise InvalidParameterError("structured_outputs", str(error)) from None
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameterError(
                "structured_outputs", "must be a StructuredOutputsParams or a dict of its fields"
            )
        self._validate()

    def _validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise InvalidParameterError(param, message)

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                fail(name, f"must be a finite number, got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            fail("seed", f"must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            fail("best_of", f"must be an integer >= n={self.n}, got {self.best_of!r}")
        if self.use_beam_search:
            self._validate_beam_search(fail)
        if self.temperature < 0:
            fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            fail("top_k", f"must be an integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < -1):
                # -1: the whole vocabulary (vLLM's); the ceiling is the engine's max_logprobs
                fail(name, f"must be an integer >= 0, or -1 for the whole vocabulary, got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        self._validate_token_constraints(fail)

    def _validate_token_constraints(self, fail: Callable[[str, str], None]) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must map token ids to biases")
            for token, bias in self.logit_bias.items():  # type: ignore[union-attr]
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    fail("logit_bias", f"keys must be token ids (non-negative integers), got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
                    fail("logit_bias", f"biases must be finite numbers, got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (
                not isinstance(ids, list)
                or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)
            ):
                fail("allowed_token_ids", "must be a non-empty list of token ids (non-negative integers)")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            fail("bad_words", "must be a list of non-empty strings")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (
            isinstance(truncate, bool) or not isinstance(truncate, int) or (truncate < 1 and truncate != -1)
        ):
            fail("truncate_prompt_tokens", f"must be an integer >= 1, or -1 for the context window; got {truncate!r}")

    def _validate_beam_search(self, fail: Callable[[str, str], None]) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            fail("beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        if self.n > self.beam_width:
            fail("n", f"beam search returns at most beam_width={self.beam_width} sequences, got n={self.n}")
        if self.best_of is not None:
            fail("best_of", "is for sampling; beam search keeps beam_width candidates")
        if not abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY:
            fail(
                "length_penalty",
                f"must be in [-{MAX_ABS_LENGTH_PENALTY:g}, {MAX_ABS_LENGTH_PENALTY:g}], got {self.length_penalty}",
            )
        if self.early_stopping not in (True, False, "never"):
            fail("early_stopping", f'must be True, False or "never", got {self.early_stopping!r}')
        for name, default in _SAMPLING_DEFAULTS.items():
            if getattr(self, name) != default:
                fail(name, "beam search is deterministic and does not use it")

    def with_output_kind(self, kind: RequestOutputKind) -> SamplingParams:
        """A copy asking for `kind` of outputs (the fields are as validated already)."""
        params = copy.copy(self)
        params.output_kind = kind
        return params

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs at once for this request."""
        if self.use_beam_search:
            return self.beam_width
        return self.best_of if self.best_of is not None else self.n

    @property
    def tracks_cumulative_logprob(self) -> bool:
        """Whether outputs carry `cumulative_logprob` (as vLLM: only when logprobs are asked
        for, or when it ranks the results: best_of > n and beam search)."""
        ranks = self.use_beam_search or (self.best_of is not None and self.best_of > self.n)
        return ranks or self.logprobs is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_token_constraints(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
