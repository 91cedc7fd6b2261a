"""What a request is checked and prepared with before it enters the engine: its prompt
tokenized and truncated, its bad words tokenized, its structured-output constraint
compiled, its prompt, `max_tokens`, token ids, logprobs and KV role checked against the
engine's limits.

None of it reads the engine's changing state (the limits are fixed once the engine is
built), so the adder threads run the slow parts (tokenizing, compiling) before a request
is handed to the engine thread; `LLMEngine.add_request` runs the checks again for callers
that come with raw input. Every refusal is an `InvalidParameterError` naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagefleet.engine.core.kv_groups import ONE_GROUP, KVGroups, needed_blocks, window_blocks
from pagefleet.engine.errors import InvalidParameterError, PromptTooLongError
from pagefleet.engine.front.inputs import PreparedPrompt, PromptType, parse_prompt, prompt_cache_salt
from pagefleet.engine.kv_transfer.params import RemoteKV, transfer_params
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.sample.structured_outputs import GrammarCompiler


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, as it would start the text and as it would follow a
    space (distinct variants only)."""
    variants: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in variants:
                variants.append(ids)
    return variants


def worst_case_blocks(
    num_prompt_tokens: int,
    max_tokens: int,
    num_sequences: int,
    block_size: int,
    groups: KVGroups = ONE_GROUP,
    chunk_tokens: int = 0,
) -> int:
    """The most KV blocks a request can ever hold at once: in a full group, its prompt's
    blocks (shared by every sample) plus, per sample, the blocks of `max_tokens` outputs
    and one copy of the part-filled block the prompt ends in (copy-on-write); a lone
    sequence needs just the blocks of prompt and output together. A sliding group holds at
    most each sample's window (and its copy-on-write copy) and a prefill chunk of
    `chunk_tokens`. A request above the whole cache can never run."""
    if num_sequences == 1:
        full = -(-(num_prompt_tokens + max_tokens) // block_size)
    else:
        full = -(-num_prompt_tokens // block_size) + num_sequences * (-(-max_tokens // block_size) + 1)
    total = 0
    for window in groups.windows:
        if window is None:
            total += full
        else:
            held = num_sequences * (window_blocks(window, block_size) + 1) + -(-chunk_tokens // block_size)
            total += min(full, held)
    return total


class RequestChecks:
    """The engine's fixed limits, and the checks and preparations that use them.

    Args:
        tokenizer: the model's (None with skip_tokenizer_init).
        vocab_size, eos_token_ids: the model's.
        max_model_len, max_logprobs: the engine's limits (`max_logprobs` -1 resolved).
        block_size, num_blocks, groups: the KV cache's, for the worst case a request may
            need (with `chunk_tokens`, the longest prefill chunk).
        kv_role: "prefill", "decode" or "both".
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        max_model_len: int,
        max_logprobs: int,
        block_size: int,
        num_blocks: int,
        kv_role: str,
        groups: KVGroups = ONE_GROUP,
        chunk_tokens: int = 0,
        has_state: bool = False,
    ) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.max_model_len, self.max_logprobs = max_model_len, max_logprobs
        self.block_size, self.num_blocks, self.kv_role = block_size, num_blocks, kv_role
        self.groups, self.chunk_tokens = groups, chunk_tokens
        self.has_state = has_state  # a model with state layers: KV from outside brings their state
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request

    def prompt_token_ids(self, prompt: PromptType, params: SamplingParams) -> list[int]:
        """The token ids the engine computes for `prompt`: tokenized, then truncated to its
        last `truncate_prompt_tokens` (-1: as many as the context window holds)."""
        prompt = parse_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "prompt", "this engine has no tokenizer (skip_tokenizer_init=True): use token ids"
                )
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = list(prompt)
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[-keep:]

    def prepare_prompt(self, prompt: PromptType, params: SamplingParams) -> PreparedPrompt:
        """`prompt` tokenized and truncated as its request will compute it; reads no engine
        state, so any thread may call it.

        Raises:
            InvalidParameterError: a prompt of an unknown shape, a bad `cache_salt`, or text
                for an engine without a tokenizer.
        """
        cache_salt = prompt_cache_salt(prompt)
        parsed = parse_prompt(prompt)
        text = parsed if isinstance(parsed, str) else None
        return PreparedPrompt(text, self.prompt_token_ids(parsed, params), cache_salt)

    def with_bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        """`params`, or a copy with its `bad_words` tokenized (the caller's object is never
        written); reads no engine state, so any thread may call it."""
        if not params.bad_words or params.bad_words_token_ids:
            return params
        if self.tokenizer is None:
            raise InvalidParameterError("bad_words", "this engine has no tokenizer (skip_tokenizer_init=True)")
        return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))

    def with_logprobs_resolved(self, params: SamplingParams) -> SamplingParams:
        """`params`, or a copy whose logprobs of -1 (the whole vocabulary) are the vocabulary's
        size, so that `max_logprobs` bounds them like any number."""
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        return dataclasses.replace(params, **whole) if whole else params

    def check_token_constraints(self, params: SamplingParams) -> None:
        """Check every token id against the vocabulary and the logprobs asked for against
        `max_logprobs`."""
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                kind = "sample" if name == "logprobs" else "prompt"  # vLLM's words
                raise InvalidParameterError(
                    name,
                    f"Requested {kind} logprobs of {asked}, which is greater than max allowed: "
                    f"{self.max_logprobs} (--max-logprobs)",
                )
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("logit_bias", list(params.logit_bias or {})),
        ):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise InvalidParameterError(
                    name, f"token id {outside[0]} is out of vocabulary (token ids are in [0, {vocab}))"
                )

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled structured-output constraint of `params` (None without one); cached,
        so callers that compile ahead, off the engine thread, make `add_request` cheap.

        Raises:
            InvalidParameterError: for a constraint that does not compile, or no tokenizer.
        """
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "structured_outputs", "this engine has no tokenizer (skip_tokenizer_init=True)"
                )
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars.compile(params.structured_outputs)

    def matcher(self, grammar: Any) -> Any:
        """A fresh matcher of a compiled constraint, for one sequence."""
        assert self._grammars is not None, "compile_grammar made the compiler"
        return self._grammars.matcher(grammar)

    def check_kv_role(self, params: SamplingParams, remote_kv: RemoteKV | None, token_ids: list[int]) -> None:
        role = self.kv_role
        transfer = transfer_params(params)
        if transfer is not None and transfer.remote_decode and role == "decode":
            raise InvalidParameterError(
                "kv_transfer_params", "this replica decodes (--role decode): send do_remote_decode to a prefill replica"
            )
        if remote_kv is not None:
            if role == "prefill":
                raise InvalidParameterError(
                    "kv_transfer_params",
                    "this replica prefills (--role prefill): send do_remote_prefill to a decode replica",
                )
            if remote_kv.num_tokens >= len(token_ids) or not self._fits(remote_kv):
                raise InvalidParameterError("kv_transfer_params", "the pulled KV does not fit this prompt")
            if self.has_state != (remote_kv.state is not None) or (
                self.has_state and remote_kv.num_tokens % self.block_size
            ):
                raise InvalidParameterError(
                    "kv_transfer_params", "the pulled KV does not carry this model's state layers at a block boundary"
                )

    def _fits(self, remote_kv: RemoteKV) -> bool:
        """Whether `remote_kv` carries, for each layer, every block its KV cache group needs
        to go on from its tokens (`needed_blocks`)."""
        ranges = needed_blocks(self.groups, remote_kv.num_tokens, self.block_size)
        if len(remote_kv.keys) != self.groups.num_layers:
            return False
        return all(
            remote_kv.first_block(layer) <= ranges[group].start
            and remote_kv.first_block(layer) + len(remote_kv.keys[layer]) >= ranges[group].stop
            for layer, group in enumerate(self.groups.layer_groups)
        )

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidParameterError("prompt", "the prompt is empty")
        vocab = self.vocab_size
        outside = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if outside:
            raise InvalidParameterError(
                "prompt", f"token id {outside[0]!r} is out of vocabulary (token ids are integers in [0, {vocab}))"
            )
        if len(token_ids) > self.max_model_len:
            raise PromptTooLongError(
                "prompt",
                f"the prompt has {len(token_ids)} tokens, more than this model's context "
                f"window of {self.max_model_len} tokens (max_model_len)",
            )

    def resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise PromptTooLongError(
                "max_tokens",
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"this model's context window of {self.max_model_len} tokens",
            )
        if max_tokens < 1:
            raise PromptTooLongError(
                "prompt", f"the prompt fills the whole context window of {self.max_model_len} tokens"
            )
        worst_case = worst_case_blocks(
            num_prompt, max_tokens, params.num_sequences, self.block_size, self.groups, self.chunk_tokens
        )
        if worst_case > self.num_blocks:
            raise PromptTooLongError(
                "max_tokens",
                f"this request may need {worst_case} KV blocks but the whole cache has "
                f"{self.num_blocks}; lower max_tokens, n, best_of or beam_width",
            )
        return max_tokens
