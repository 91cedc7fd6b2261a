"""Contracts shared by the engine server, the gateway and the operator.

Only pydantic here (no torch, transformers or triton), so that the gateway and the
operator stay small: the OpenAI request shapes and the Redis replica record.
"""
