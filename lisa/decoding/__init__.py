"""Decoding: sampling, draft trees, verifiers, the decode loops and their cost model."""
