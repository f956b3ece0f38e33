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

    from lisa.data.text import minilm_path

    tok = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)  # any local tokenizer will do
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=tok.vocab_size, d_model=16, d_kv=4, num_heads=4, num_layers=1, d_ff=32,
                   feed_forward_proj="gated-gelu", is_encoder_decoder=True)
    T5EncoderModel(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def make_tiny_lumina(path, K: int = 16):
    """A tiny random Lumina-mGPT / Chameleon checkpoint in transformers' format (4 layers, GQA, vocab 8900, a
    K-code VQ-VAE of downsample 2, weights perturbed far from init) plus a word-level tokenizer.json, at `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration, PreTrainedTokenizerFast

    letters = lambda n: "".join(chr(ord("A") + int(d)) for d in str(n))  # noqa: E731
    vmap = {f"IMGIMG{letters(c)}Z": 4 + c for c in range(K)}
    vmap["<image>"] = 8711
    cfg = ChameleonConfig(vocab_size=8900, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          vocabulary_map=vmap,
                          vq_config=dict(embed_dim=8, num_embeddings=K, base_channels=32, channel_multiplier=[1, 1],
                                         num_res_blocks=1, latent_channels=32, resolution=32, attn_resolutions=[]))
    torch.manual_seed(0)
    model = ChameleonForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # weights far from init, so that norms, biases and RoPE all matter
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() < 2 or "norm" in name else 0.1))
    model.save_pretrained(str(path))
    words = ["<unk>", "<s>", "generate", "an", "image", "of", "48x48", "according", "to", "the", "following",
             "prompt", ":", "a", "red", "apple", "cat", "on", "mat", "grey", "boot", "coat", "shirt", "black", ","]
    tok = Tokenizer(models.WordLevel({w: 8810 + i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(str(path))
    return path


def make_tiny_vqgan(lumina_dir, out, K: int = 16):
    """Chameleon's vqgan.ckpt layout (taming) for the tiny checkpoint: its transformers VQ-VAE encoder, and a
    random decoder written under taming's names (up levels by resolution, mid.block_1 / attn_1 / block_2)."""
    import torch
    from transformers import ChameleonForConditionalGeneration

    from lisa.models.vq import VQModel, vq_config

    hf = ChameleonForConditionalGeneration.from_pretrained(str(lumina_dir), local_files_only=True)
    torch.manual_seed(1)
    cfg = vq_config(codebook_size=K, codebook_embed_dim=8, codebook_l2_norm=False, encoder_ch_mult=[1, 1],
                    decoder_ch_mult=[1, 1], z_channels=32, ch=32, num_res_blocks=1, level_attn=False)
    dec = {}
    for k, v in VQModel(cfg).state_dict().items():
        parts = k.split(".")
        if parts[0] != "decoder":
            continue
        if parts[1] == "conv_blocks":
            parts = ["decoder", "up", str(1 - int(parts[2])), "block" if parts[3] == "res" else parts[3]] + parts[4:]
        elif parts[1] == "mid":
            parts = ["decoder", "mid", ["block_1", "attn_1", "block_2"][int(parts[2])]] + parts[3:]
        dec[".".join(parts)] = v
    dec["loss.discriminator.main.0.weight"] = torch.zeros(1)  # training-loss keys: dropped by the importer
    torch.save({"state_dict": hf.model.vqmodel.state_dict() | dec}, out)
    return out, dec
