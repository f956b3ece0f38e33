"""Benchmarks: decode speed on the CPU and GPU, and resource estimates."""
