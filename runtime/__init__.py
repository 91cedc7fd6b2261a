"""What the engine server, the gateway and the operator run alike, beside the contracts of
`pagefleet.protocol`: the ASGI error guard, body limit and disconnect handling (http.py),
OpenTelemetry's set-up and server spans (tracing.py), the Prometheus endpoint of a process
that has no web app (metrics_http.py), chat-template rendering that the engine and the
gateway's prefix hashing must agree on (chat_prompt.py), and the Responses API's store
(response_store.py).

Light like `protocol/`: no torch, transformers or triton.
"""
