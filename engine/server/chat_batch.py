"""vLLM's `POST /v1/chat/completions/batch`: several conversations under one set of
parameters, run together (the engine batches them) and answered as one chat completion
whose choices are the conversations' in order (index `conversation * n + choice`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi.responses import JSONResponse

from pagefleet.engine.server.chat import ChatRun, assistant_message, start_chat
from pagefleet.engine.server.events import usage
from pagefleet.engine.server.generation import last_output, response_id_for
from pagefleet.engine.server.state import ServerState
from pagefleet.protocol.openai import BatchChatCompletionRequest


async def create_batch_chat_completion(
    state: ServerState, body: BatchChatCompletionRequest, header_id: str | None
) -> JSONResponse:
    """Raises the first conversation's error if any is refused; the others are then
    stopped and free their blocks."""
    response_id = response_id_for("chatcmpl", header_id, body.request_id)
    chats = body.conversations()
    started = await asyncio.gather(
        *(start_chat(state, chat, f"{response_id}-{i}") for i, chat in enumerate(chats)), return_exceptions=True
    )
    runs = [run for run in started if isinstance(run, ChatRun)]
    if len(runs) < len(started):
        for run in runs:
            await run.stream.aclose()
        raise next(error for error in started if isinstance(error, BaseException))
    finals = await asyncio.gather(*(last_output(run.stream) for run in runs))
    choices: list[dict[str, Any]] = []
    for conversation, (run, final) in enumerate(zip(runs, finals, strict=True)):
        for completion in final.outputs:
            message, reason = assistant_message(completion, run.calling)
            choices.append(
                {
                    "index": conversation * body.n + completion.index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": reason,
                    "stop_reason": completion.stop_reason,
                }
            )
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.served_name(body.model),
            "choices": choices,
            "usage": usage(list(finals), state.settings.enable_prompt_tokens_details),
        }
    )
