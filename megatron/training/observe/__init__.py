"""Observability: metrics and MFU, console warnings, profiling, memory snapshots, loss drift."""
