"""Benchmarks: eager vs TorchInductor vs opfuse, side by side in one process."""
