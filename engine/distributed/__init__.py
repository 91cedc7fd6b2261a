"""Tensor parallelism: one model split across processes (docs/engine.md)."""
