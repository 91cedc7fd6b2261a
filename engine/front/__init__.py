"""What callers drive: `LLM`, `AsyncEngine`, the step loop (`LLMEngine`) with its request
checks, inputs and outputs, detokenizing and output processing."""
