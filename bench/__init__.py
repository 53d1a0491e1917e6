"""Benchmarks: every figure of the service beside its anchor, measured in the same run."""
