"""Model families, one module each, found by the checkpoint's `architectures` (registry.py)."""
