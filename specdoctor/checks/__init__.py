"""Checks on checkpoints and loaded drafters; each module returns findings."""
