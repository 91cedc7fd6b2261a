"""Triton kernels for the paged KV cache, each beside its plain-torch reference.

One op per module: the `@triton.jit` kernel, a launcher that checks its tensors, and
`<op>_torch`, the reference that is also the CPU path and the tests' oracle:
`reshape_and_cache`, `paged_attention_decode`, `paged_attention_prefill`, `copy_blocks`.

Nothing is imported here on purpose. From the repository root this folder is also
importable as a top-level `kernels`, the name of a Hugging Face package that transformers
probes for at import; an empty package keeps that probe harmless (and triton unloaded).
"""
