"""Triton kernels for the hot paths, each with a plain-torch reference."""
