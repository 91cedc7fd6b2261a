"""Choosing the next tokens: sampling parameters, the sampler, beam search and structured
outputs."""
