"""Checkpoints: atomic distributed save and load, per-file checksums, what a failed save says."""
