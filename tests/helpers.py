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


def make_tiny_t5(path):
    """A tiny random T5 encoder in transformers' format (the MiniLM tokenizer beside it) at `path`."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    from lisa.text import minilm_path

    tok = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)  # any local tokenizer will do
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=tok.vocab_size, d_model=16, d_kv=4, num_heads=4, num_layers=1, d_ff=32,
                   feed_forward_proj="gated-gelu", is_encoder_decoder=True)
    T5EncoderModel(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path
