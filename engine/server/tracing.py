"""One `llm_request` span per engine request (vLLM's span name), child of the HTTP request's
span, with OpenTelemetry's GenAI attributes (`gen_ai.request.model`, the sampling settings,
token counts, finish reasons) and vLLM's latency attributes, and the request's moments in
the engine as events: scheduled (it left the queue), each prefill chunk, first token, each
preemption, finished.

The span is written once the request ends, from the times the engine recorded (its
`RequestEvent`s), so the engine's loop never calls OpenTelemetry.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context, trace

from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.sample.sampling_params import SamplingParams


class RequestTracing:
    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def record(
        self,
        parent: context.Context,
        operation: str,
        model: str,
        response_id: str,
        request_id: str,
        params: SamplingParams,
        output: RequestOutput | None,
        started: float,
        error: BaseException | None = None,
    ) -> None:
        """Write the span of a request that ended now (`request_id`: its id in the engine,
        within the response `response_id`; `started`: when the server took it,
        `time.monotonic()`); `output` is its last, None if it ended before any."""
        now_mono, now_ns = time.monotonic(), time.time_ns()

        def wall(moment: float) -> int:
            return now_ns - int((now_mono - moment) * 1e9)

        metrics = output.metrics if output is not None else {}
        arrival = metrics.get("arrival_time", started)
        span = self.tracer.start_span(
            "llm_request",
            context=parent,
            kind=trace.SpanKind.INTERNAL,
            start_time=wall(min(started, arrival)),
            attributes=_request_attributes(operation, model, params)
            | {
                "gen_ai.response.id": response_id,
                "pagefleet.request_id": request_id,
            },
        )
        events = list(output.events) if output is not None else []
        for event in events:
            span.add_event(event.name, event.attributes, timestamp=wall(event.time))
        first_token = metrics.get("first_token_time")
        if first_token is not None:
            span.add_event("first_token", timestamp=wall(first_token))
            span.set_attribute("gen_ai.latency.time_to_first_token", first_token - arrival)
        scheduled = next((event.time for event in events if event.name == "scheduled"), None)
        if scheduled is not None:
            span.set_attribute("gen_ai.latency.time_in_queue", scheduled - arrival)
        span.set_attribute("gen_ai.latency.e2e", now_mono - arrival)
        span.set_attribute("pagefleet.preemptions", sum(event.name == "preempted" for event in events))
        _record_outcome(span, output, error)
        span.add_event("finished", timestamp=now_ns)
        span.end(end_time=now_ns)


def _request_attributes(operation: str, model: str, params: SamplingParams) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "pagefleet",
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n,
    }
    if params.top_k > 0:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    return {key: value for key, value in attributes.items() if value is not None}


def _record_outcome(span: trace.Span, output: RequestOutput | None, error: BaseException | None) -> None:
    """The request's usage and finish reasons, and its error if it failed."""
    if output is not None:
        reasons = [completion.finish_reason or "abort" for completion in output.outputs]
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": output.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": output.usage.completion_tokens,
                "pagefleet.cached_prompt_tokens": output.usage.cached_prompt_tokens,
                "gen_ai.response.finish_reasons": reasons if output.finished else ["abort"],
            }
        )
    if error is not None:
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(trace.StatusCode.ERROR, str(error))
    elif output is not None and output.error:
        span.set_attribute("error.type", "engine_error")
        span.set_status(trace.StatusCode.ERROR, output.error)
