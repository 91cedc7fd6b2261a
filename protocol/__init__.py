"""Contracts shared by the engine server, the gateway and the operator.

Nothing heavy here (no torch, transformers or triton), so that the gateway and the
operator stay small: the OpenAI request shapes and the Redis replica record (pydantic),
the HTTP error shape (starlette), and how traces are carried between the parts
(OpenTelemetry's W3C propagation).
"""
