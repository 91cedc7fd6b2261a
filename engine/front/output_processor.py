"""Per-token bookkeeping after sampling: append, logprobs, detokenize, stop checks, and
building the `RequestOutput` a caller sees.

The output processor is the one writer of a sequence's tokens, text, logprobs, stop state
(finish and stop reasons) and what its DELTA outputs have sent, and of a request's prompt
logprobs. Only the step's update (and an abort, through it) calls it.
"""

from __future__ import annotations

from pagefleet.engine.core.request import Request, Sequence
from pagefleet.engine.front.detokenizer import Detokenizer, find_stop_string
from pagefleet.engine.front.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, Usage
from pagefleet.engine.sample.beam_search import Continuation
from pagefleet.engine.sample.sampler import SampleResult, TokenLogprobs
from pagefleet.engine.sample.sampling_params import RequestOutputKind
from pagefleet.engine.worker.model_runner import PromptLogprobs


def _advance_grammar(seq: Sequence, token_id: int) -> bool:
    """Move a constrained sequence's matcher past its new token; False if the constraint
    allowed no token at all (every one masked: the constraint is complete but its stop
    token is barred, or other constraints left nothing), so the sampled one is not its."""
    if seq.grammar is None or seq.grammar.is_terminated():
        return True
    return bool(seq.grammar.accept_token(token_id))


class OutputProcessor:
    def __init__(self, detokenizer: Detokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.detokenizer = detokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def start(self, request: Request) -> None:
        """Ready a new request's sequences for incremental detokenization."""
        for seq in request.sequences:
            self.detokenizer.start(seq)

    def finish_unfinished(self, request: Request, reason: str) -> None:
        """End every sequence still running with `reason` ("abort", "error")."""
        for seq in request.unfinished_sequences:
            seq.finish_reason = reason

    def extend_beams(self, beams: list[Sequence], continuations: list[Continuation]) -> None:
        """Beam i takes continuation i's token and score (beams already forked as needed)."""
        for index, (beam, continuation) in enumerate(zip(beams, continuations, strict=True)):
            beam.index = index
            beam.token_ids.append(continuation.token_id)
            beam.cumulative_logprob = continuation.cumulative_logprob
            # Beams take only candidates with a finite score, which their constraint allowed.
            if not _advance_grammar(beam, continuation.token_id):
                raise RuntimeError(f"beam took token {continuation.token_id}, which its constraint forbids")

    def append_token(self, request: Request, seq: Sequence, result: SampleResult, row: int) -> None:
        token_id = result.token_ids[row]
        params = request.params
        if not _advance_grammar(seq, token_id):
            seq.finish_reason = "stop"  # nothing more can be generated within the constraint
            return
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += result.logprobs[row]
        if params.logprobs is not None:
            assert result.details is not None, "the sampler skipped logprobs that were asked for"
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(self._position(token_id, result.details, result.detail_rows[row]))
        previous_len = len(seq.text)
        seq.text += self.detokenizer.step(seq, params.skip_special_tokens)
        self._check_stop(request, seq, token_id, len(seq.text) - previous_len)

    def _check_stop(self, request: Request, seq: Sequence, token_id: int, num_new_chars: int) -> None:
        params = request.params
        if seq.grammar is not None and seq.grammar.is_terminated():  # the constraint is complete
            seq.finish_reason = "stop"
            return
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
                return
            if token_id in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token_id
                return
            if params.stop and num_new_chars:
                found = find_stop_string(seq.text, num_new_chars, params.stop)
                if found is not None:
                    stop, index = found
                    seq.text = seq.text[: index + len(stop)] if params.include_stop_str_in_output else seq.text[:index]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if seq.num_output_tokens >= request.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def add_prompt_logprobs(self, request: Request, result: PromptLogprobs) -> None:
        assert request.prompt_logprobs is not None, "prompt logprobs computed for a request that did not ask"
        seq = request.sequences[0]
        # After a recompute the same positions come again; keep the first answer.
        for offset in range(len(result.values.logprobs)):
            token_index = result.start_position + offset + 1
            if token_index == len(request.prompt_logprobs):
                request.prompt_logprobs.append(self._position(seq.token_ids[token_index], result.values, offset))

    def _position(self, token_id: int, values: TokenLogprobs, row: int) -> PositionLogprobs:
        """Row `row` of `values` as {token id: Logprob} for the token and its alternatives."""
        entry = {token_id: Logprob(values.logprobs[row], values.ranks[row], self.detokenizer.token_text(token_id))}
        top = zip(values.top_ids[row], values.top_logprobs[row], strict=True)
        for top_rank, (top_id, value) in enumerate(top, start=1):
            entry.setdefault(top_id, Logprob(value, top_rank, self.detokenizer.token_text(top_id)))
        return entry

    def make_output(self, request: Request) -> RequestOutput | None:
        """The request's output after a step, in its `output_kind`; None when that kind has
        nothing to say (FINAL_ONLY before the end, DELTA with nothing new)."""
        finished = request.generation_ended or request.is_finished
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        ranked_at_end = request.beam is not None or len(request.sequences) > request.params.n
        if request.beam is not None:
            outputs = self._beam_outputs(request)
            num_completion = sum(len(output.token_ids) for output in outputs)
        elif kind == RequestOutputKind.DELTA and not ranked_at_end:
            outputs = self._delta_outputs(request)
            if not outputs and not finished:
                return None
            num_completion = sum(seq.num_output_tokens for seq in request.sequences)
        elif kind == RequestOutputKind.DELTA and not finished:
            return None  # best_of > n: the chosen samples are known only at the end
        else:
            outputs = self._sample_outputs(request)
            num_completion = sum(seq.num_output_tokens for seq in request.sequences)
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["first_token_time"] = request.first_token_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            usage=Usage(request.num_prompt_tokens, num_completion, request.num_cached_tokens),
            prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
            num_cached_tokens=request.num_cached_tokens,
            metrics=metrics,
            error=request.error,
            kv_transfer_params=request.kv_transfer_params,
            events=request.events,
        )

    def _sample_outputs(self, request: Request) -> list[CompletionOutput]:
        """Every sample; with best_of > n, the n with the highest cumulative logprob."""
        seqs = request.sequences
        if len(seqs) > request.params.n:
            seqs = sorted(seqs, key=lambda seq: -seq.cumulative_logprob)[: request.params.n]
        return [
            CompletionOutput(
                index=index,
                text=seq.text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if request.params.tracks_cumulative_logprob else None,
                logprobs=None if seq.logprobs is None else list(seq.logprobs),  # a snapshot: the engine appends
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for index, seq in enumerate(seqs)
        ]

    def _delta_outputs(self, request: Request) -> list[CompletionOutput]:
        """Each sample's news since its previous output (samples with none are left out).
        Until a sample ends, the text that could still become the start of a stop string
        is held back, so no text is sent that a stop string then takes away (vLLM's)."""
        params = request.params
        outputs = []
        for seq in request.sequences:
            first = seq.num_sent_tokens
            held = 0 if seq.is_finished or not params.stop else max(map(len, params.stop)) - 1
            visible = max(len(seq.text) - held, seq.num_sent_chars)
            news = seq.num_output_tokens > first or visible > seq.num_sent_chars
            if not news and not (seq.is_finished and not seq.sent_finish):
                continue
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text[seq.num_sent_chars : visible],
                    token_ids=seq.token_ids[seq.num_prompt_tokens + first :],
                    cumulative_logprob=seq.cumulative_logprob if params.tracks_cumulative_logprob else None,
                    logprobs=None if seq.logprobs is None else seq.logprobs[first:],
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            seq.num_sent_tokens, seq.num_sent_chars, seq.sent_finish = seq.num_output_tokens, visible, seq.is_finished
        return outputs

    def _beam_outputs(self, request: Request) -> list[CompletionOutput]:
        """The n best finished beams once the search ends; the running beams before."""
        assert request.beam is not None
        skip_special = request.params.skip_special_tokens
        if request.beam.done:
            beams = [(h.token_ids, h.cumulative_logprob, h.finish_reason) for h in request.beam.finished]
        else:
            beams = [(seq.output_token_ids, seq.cumulative_logprob, seq.finish_reason) for seq in request.sequences]
        outputs = []
        for index, (token_ids, cumulative_logprob, finish_reason) in enumerate(beams[: request.params.n]):
            last = token_ids[-1] if token_ids else None
            stop_reason = last if finish_reason == "stop" and last in request.params.stop_token_ids else None
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=self.detokenizer.decode(token_ids, skip_special),
                    token_ids=token_ids,
                    cumulative_logprob=cumulative_logprob,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
            )
        return outputs
