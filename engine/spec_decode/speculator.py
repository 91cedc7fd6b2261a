"""The engine's speculation: which sequences may speculate, their draft tokens, and the
counters vLLM's metrics report.

Draft tokens are verified in the next forward pass together with the sequence's last
token, as a short chunk through the attention paths chunked prefill uses; the sampler then
walks the drafts position by position (`ModelRunner._verify`), and the step's update keeps the
accepted ones and rolls the rest back (their KV slots are overwritten later; they never
enter the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.engine.core.request import Request, Sequence
from pagefleet.engine.spec_decode.config import SpeculativeConfig
from pagefleet.engine.spec_decode.load_switch import LoadSwitch
from pagefleet.engine.spec_decode.ngram import propose_ngram
from pagefleet.engine.spec_decode.suffix import RecentOutputs, propose_suffix


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's counters: `vllm:spec_decode_num_drafts` (sequences that verified drafts, once a
    step each), `..._num_draft_tokens`, `..._num_accepted_tokens` and, per draft position,
    `..._num_accepted_tokens_per_pos`."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    """Proposes drafts when the scheduler asks; its counters, the load switch's
    measurements and `suffix`'s recent outputs are written only by the step's update,
    after each step, on the engine thread."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.switch = LoadSwitch(config.num_speculative_tokens)
        self.recent = RecentOutputs(config.suffix_decoding_max_cached_requests if config.method == "suffix" else 0)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    @staticmethod
    def can_speculate(request: Request) -> bool:
        """One sampled sequence; beam search and several samples (n, best_of) run without
        speculation, in the same batch."""
        return request.beam is None and len(request.sequences) == 1

    def draft_length(self, num_decoding: int) -> int:
        """Drafts per sequence this step (the load switch; vLLM's `disable_by_batch_size`
        turns it off at that many sequences whatever the measurements say)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_decoding >= limit:
            return 0
        return self.switch.draft_length(num_decoding)

    def propose(self, request: Request, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts for `seq`, never past its `max_tokens` or the model's
        length (the token sampled after the last draft must fit too)."""
        room = min(request.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        num_tokens = min(num_tokens, room)
        if num_tokens < 1:
            return []
        config = self.config
        if config.method == "suffix":
            drafts = propose_suffix(
                seq.token_ids,
                self.recent,
                num_tokens,
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )
        else:
            drafts = propose_ngram(seq.token_ids, num_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        return _allowed_prefix(seq, drafts)

    def remember(self, request: Request) -> None:
        """A finished request's outputs, for `suffix` lookups by later requests."""
        for seq in request.sequences:
            self.recent.add(seq.output_token_ids)

    def snapshot(self) -> SpecDecodeStats:
        stats = self.stats
        return SpecDecodeStats(
            stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position)
        )

    def observe_step(self, num_tokens: int, num_draft_chunks: int, seconds: float) -> None:
        """A decoding step's size and time, for the load switch."""
        self.switch.observe_step(num_tokens, num_draft_chunks, seconds)

    def count(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verification: `num_accepted` of its `num_drafted` drafts kept."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        self.switch.observe_verification(min(num_accepted + 1, num_drafted), num_accepted)


def _allowed_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
    """The drafts a constrained sequence's grammar accepts, up to the first it refuses
    (checked on a copy of its matcher; the sequence's own is untouched)."""
    if seq.grammar is None or not drafts:
        return drafts
    matcher = seq.grammar.fork()
    for index, token_id in enumerate(drafts):
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            return drafts[:index]
    return drafts
