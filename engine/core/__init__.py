"""The engine's core: requests and their sequences, the scheduler, and the paged KV cache
(block pool, KV cache manager, host memory for swapping)."""
