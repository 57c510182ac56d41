"""Triton kernels (see issue: Triton kernels). Placeholder until implemented."""
