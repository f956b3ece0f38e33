"""lisa: locality-informed speculative decoding for autoregressive image generation."""

__version__ = "0.1.0"
