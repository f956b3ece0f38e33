"""Prefect tasks: thin wrappers, one call into lisa.stages each; they pass paths and metrics, never tensors."""
