"""Tiny models shared by the tests."""
from lisa.models.gpt import Transformer, gpt_config


def micro_gpt(**overrides) -> Transformer:
    cfg = dict(vocab_size=64, block_size=16, num_classes=10)
    cfg.update(overrides)
    return Transformer(gpt_config("GPT-micro", **cfg)).eval()


def micro_t2i(**overrides) -> Transformer:
    cfg = dict(vocab_size=64, block_size=16, model_type="t2i", caption_dim=24, cls_token_num=5)
    cfg.update(overrides)
    return Transformer(gpt_config("GPT-micro", **cfg)).eval()
