"""Contracts shared by the engine server, the gateway and the operator: what one part sends
and another reads, and nothing that runs.

The OpenAI, Anthropic and Responses request and response shapes (pydantic), the replica
record, the demand signal, the prefix index's Redis keys and the block hash, the tokenizer
description, the KV transfer parameters and the headers the parts send each other. What the
parts run alike (middleware, tracing, chat rendering, the response store) is in
`pagefleet.runtime`. Nothing heavy here (no torch, transformers or triton), so that the
gateway and the operator stay small.
"""
