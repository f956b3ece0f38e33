"""Architectures only: the LlamaGen-compatible target GPT and VQ tokenizer (drafters come later)."""
from lisa.models.gpt import PRESETS, GPTConfig, GPTOutput, Transformer, default_taps, gpt_config
from lisa.models.vq import VQ_PRESETS, VQConfig, VQModel, vq_config

__all__ = ["PRESETS", "GPTConfig", "GPTOutput", "Transformer", "default_taps", "gpt_config",
           "VQ_PRESETS", "VQConfig", "VQModel", "vq_config"]
