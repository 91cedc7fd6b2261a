"""`POST /v1/completions`: one engine request per prompt, `n` choices each."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from pagefleet.engine.front.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.events import ChunkWriter, finish_reason, prompt_logprobs, sse, token_name, usage
from pagefleet.engine.server.generation import (
    DeltaTracker,
    Outputs,
    generate,
    last_output,
    merge,
    response_id_for,
    start_all,
)
from pagefleet.engine.server.params import sampling_params
from pagefleet.engine.server.state import ServerState, tokenizer_of
from pagefleet.engine.server.streaming import EventStreamResponse
from pagefleet.protocol.openai import CompletionRequest


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    prompt = body.prompt
    if prompt is None:  # prompt_embeds alone (the request's validator let nothing else through)
        raise OpenAIError(400, "prompt_embeds: this server takes prompts as text or token ids", "prompt_embeds")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt: must not be empty", "prompt")
    token_ids = [item for item in prompt if isinstance(item, int)]
    if len(token_ids) == len(prompt):
        return [token_ids]
    # The request's type admits no mixed list: these are strings or token lists.
    return [item for item in prompt if not isinstance(item, int)]


def _params(body: CompletionRequest) -> SamplingParams:
    extra: dict[str, Any] = {}
    if body.logprobs is not None:
        extra["logprobs"] = body.logprobs
        if body.echo:  # -1, the whole vocabulary, is the most
            asked = (body.logprobs, body.prompt_logprobs or 0)
            extra["prompt_logprobs"] = -1 if -1 in asked else max(asked)
    if body.use_beam_search:
        # vLLM's convention: best_of is the beam width; the n best beams are returned.
        extra.update(use_beam_search=True, beam_width=body.best_of or body.n, length_penalty=body.length_penalty)
    elif body.best_of is not None:
        extra["best_of"] = body.best_of
    return sampling_params(body, body.max_tokens, **extra)


class _LogprobsBuilder:
    """The completions API's logprobs object, built up position by position."""

    def __init__(self, num_top: int, as_ids: bool, first_text: str = "") -> None:
        self.num_top = math.inf if num_top == -1 else num_top  # -1: the whole vocabulary
        self.as_ids, self.first_text = as_ids, first_text
        self.value: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.offset = 0

    def add(self, token_id: int, position: PositionLogprobs | None) -> None:
        if position is None:  # the first prompt token: its text, and no distribution (vLLM's)
            text, logprob, top = token_name(token_id, self.first_text, self.as_ids), None, None
        else:
            chosen = position[token_id]
            text, logprob = token_name(token_id, chosen.decoded_token, self.as_ids), chosen.logprob
            # The chosen token and the top `logprobs` (vLLM's: `logprobs: 0` gives the chosen alone).
            top = {
                token_name(tid, lp.decoded_token, self.as_ids): lp.logprob
                for tid, lp in position.items()
                if lp.rank <= self.num_top or tid == token_id
            }
        self.value["tokens"].append(text)
        self.value["token_logprobs"].append(logprob)
        self.value["top_logprobs"].append(top)
        self.value["text_offset"].append(self.offset)
        self.offset += len(text)


def _choice_logprobs(
    state: ServerState, body: CompletionRequest, output: RequestOutput, completion: CompletionOutput, start: int = 0
) -> dict[str, list[Any]] | None:
    """Logprobs of `completion`'s tokens from `start` (and of the prompt first, with echo)."""
    if completion.logprobs is None or body.logprobs is None:
        return None
    echo = body.echo and start == 0 and output.prompt_logprobs is not None
    first_text = ""
    if echo and output.prompt_token_ids and state.engine is not None and state.engine.tokenizer is not None:
        first_text = str(state.engine.tokenizer.decode([output.prompt_token_ids[0]]))
    builder = _LogprobsBuilder(body.logprobs, body.return_tokens_as_token_ids, first_text)
    if echo and output.prompt_logprobs is not None:
        for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs, strict=False):
            builder.add(token_id, position)
    for token_id, position in zip(completion.token_ids[start:], completion.logprobs[start:], strict=True):
        builder.add(token_id, position)
    return builder.value


async def create_completion(state: ServerState, body: CompletionRequest, header_id: str | None = None) -> Any:
    engine = state.ready_engine(body.model)
    if engine.tokenizer is None:  # tokens have no text here: logprobs name them by id (vLLM's form)
        body = body.model_copy(update={"return_tokens_as_token_ids": True})
    if body.stream and body.best_of is not None and body.best_of > body.n:
        raise OpenAIError(400, "best_of: cannot be used with stream (the best are known only at the end)", "best_of")
    state.admit(engine)
    params = _params(body)
    prompts = _prompts(body)
    if body.kv_transfer_params and len(prompts) > 1:
        raise OpenAIError(400, "kv_transfer_params: a disaggregated request has one prompt", "kv_transfer_params")
    lora = state.adapters.request_for(body.model)
    response_id = response_id_for("cmpl", header_id, body.request_id)
    streams = await start_all(
        [
            generate(state, engine, prompt, params, lora, "text_completion", response_id, index, body.cache_salt)
            for index, prompt in enumerate(prompts)
        ]
    )
    if body.stream:
        model = state.served_name(body.model)
        chunk = ChunkWriter.for_request(response_id, "text_completion", model, body.stream_options, state.settings)
        return EventStreamResponse(_stream(state, body, streams, chunk))
    finals = await asyncio.gather(*(last_output(stream) for stream in streams))
    choices = []
    for prompt_index, output in enumerate(finals):
        echoed = _prompt_text(state, output) if body.echo else ""
        for completion in output.outputs:
            choice = {
                "index": prompt_index * body.n + completion.index,
                "text": echoed + completion.text,
                "logprobs": _choice_logprobs(state, body, output, completion),
                "finish_reason": finish_reason(completion.finish_reason),
                "stop_reason": completion.stop_reason,
                # vLLM's keys, always sent, null unless asked for.
                "prompt_logprobs": prompt_logprobs(output) if body.prompt_logprobs is not None else None,
                "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None,
                "token_ids": completion.token_ids if body.return_token_ids else None,
            }
            choices.append(choice)
    return JSONResponse(
        {
            "id": response_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.served_name(body.model),
            "choices": choices,
            "usage": usage(list(finals), state.settings.enable_prompt_tokens_details),
            "kv_transfer_params": finals[0].kv_transfer_params,
        }
    )


def _prompt_text(state: ServerState, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    assert state.engine is not None
    return str(tokenizer_of(state.engine).decode(output.prompt_token_ids))


async def _stream(
    state: ServerState, body: CompletionRequest, streams: list[Outputs], chunk: ChunkWriter
) -> AsyncIterator[str]:
    tracker = DeltaTracker()
    finals: dict[int, RequestOutput] = {}
    async for prompt_index, output in merge(streams):
        for completion in output.outputs:
            index = prompt_index * body.n + completion.index
            delta = tracker.delta(index, completion)
            if delta is None:
                continue
            text = _prompt_text(state, output) + delta.text if delta.is_first and body.echo else delta.text
            reason = finish_reason(completion.finish_reason)
            if text or reason is not None or delta.is_first:
                logprobs = _choice_logprobs(state, body, output, completion, delta.first_token)
                tracker.sent(index, completion)
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
                choice["stop_reason"] = None
                if body.return_token_ids:  # vLLM's: the prompt's ids once, each chunk's own ids
                    choice["token_ids"] = completion.token_ids[delta.first_token :]
                    if delta.is_first:
                        choice["prompt_token_ids"] = output.prompt_token_ids
                if body.prompt_logprobs is not None and delta.is_first:
                    choice["prompt_logprobs"] = prompt_logprobs(output)
                # One choice per chunk, as OpenAI and vLLM send them: clients read `choices[0]`.
                yield chunk([choice], chunk.so_far(output.usage.prompt_tokens, len(completion.token_ids)))
        if output.finished:
            finals[prompt_index] = output
    if chunk.include_usage:
        yield chunk([], chunk.usage([finals[i] for i in sorted(finals)]))
    yield sse("[DONE]")
