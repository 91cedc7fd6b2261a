"""Triton kernels and their torch references (see the kernels issue)."""
