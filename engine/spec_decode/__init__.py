"""Speculative decoding without a draft model: proposers that look up likely next tokens in
text already seen, and the load switch that decides how many to verify (docs/engine.md)."""
