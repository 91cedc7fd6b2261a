"""The gateway: one OpenAI endpoint for the fleet, routing each request by its `model` to
the replica with the most free KV blocks, as the replicas publish them into Redis.

It imports no torch, transformers or triton (its image stays small): only the shared
contracts of `pagefleet.protocol`, FastAPI, httpx and redis.
"""
