"""Lumina-mGPT (Chameleon-7B) targets: transformers' Chameleon checkpoints in our decode engine.

A Lumina-mGPT / Chameleon checkpoint directory is what transformers writes for `ChameleonForConditionalGeneration`:
`config.json` (model_type "chameleon", vocab 65536, `vocabulary_map` naming the 8192 image tokens "IMGIMG...Z")
and `model.safetensors` or shards + `model.safetensors.index.json` (keys `model.layers.{i}.self_attn.q_proj`, ...,
`lm_head.weight`, and, when the VQ-VAE is included, `model.vqmodel.*`). The config is read with transformers'
`ChameleonConfig`; the weights are streamed shard by shard into our `Transformer` (arch "chameleon"), whose logits
equal transformers' (tests/test_lumina.py checks it on a tiny random checkpoint) and which brings what the engine
needs: a static KV cache with per-row slots, draft-tree masks and the hidden-state taps of the EAGLE-3 drafter.

The image grammar (LumImage grammar of Lumina-mGPT, see ANCHORS.md): start-of-image 8197, two size tokens
8804 + grid (height, then width), each row of codes followed by the end-of-line token 8803, end-of-image 8196;
768 x 768 px = 48 x 48 codes + 48 EOL + 4 = 2356 tokens. Our compact vocabulary puts the image codes first
(id = code, so the VQ codebook is the geometry of ids 0..K-1 unchanged) and the grammar tokens after them;
`Transformer.token_ids` maps it onto the checkpoint's ids. `LuminaGrammar.forced(h, w)` is the engine's grammar
vector (lisa.decoding.grammar): grammar positions are forced, never sampled, drafted freely or verified.

CFG as in Lumina-mGPT: the unconditional row is the image part alone (every prompt position masked out),
batched with the conditional rows in one KV cache; tests/test_lumina.py runs the two rows as separate forwards
(Lumina-mGPT's own way) and compares them against the batched run.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from lisa.checkpoint import CheckpointError
from lisa.models.gpt import (GPTConfig, Transformer, image_grammar, rope_1d_table, rotate_half_permutation,
                             square_image_grammar)

PROMPT_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{caption}"


@dataclass(frozen=True)
class LuminaGrammar:
    """Checkpoint ids of the image grammar and the layout of our compact vocabulary."""
    codebook_size: int = 8192
    image_token_offset: int = 4  # code c -> checkpoint id c + 4 when the config has no vocabulary_map
    soi: int = 8197  # start of image
    eoi: int = 8196  # end of image
    eol: int = 8803  # end of line, after each row
    size_base: int = 8804  # size token = size_base + grid
    max_grid: int = 64  # size tokens for grids 0..max_grid (1024 px at downsample 16)

    @property
    def vocab_size(self) -> int:
        """Our ids: codes 0..K-1, then SOI, EOI, EOL, then one size token per grid 0..max_grid."""
        return self.codebook_size + 3 + self.max_grid + 1

    def ours(self, name: str, grid: int = 0) -> int:
        K = self.codebook_size
        return {"soi": K, "eoi": K + 1, "eol": K + 2, "size": K + 3 + grid}[name]

    def sequence_length(self, h: int, w: int) -> int:
        return 4 + h * (w + 1)

    def forced(self, h: int, w: int) -> Tensor:
        """(4 + h (w + 1),) our ids of the grammar tokens at their positions, -1 at the h x w code positions."""
        if not (0 < h <= self.max_grid and 0 < w <= self.max_grid):
            raise ValueError(f"LuminaGrammar: grid {h}x{w} outside 1..{self.max_grid}")
        return image_grammar(self.codebook_size, h, w)

    def codes(self, tokens: Tensor, h: int, w: int) -> Tensor:
        """(B, 4 + h (w + 1)) generated ids -> (B, h, w) VQ codes; a sequence that breaks the grammar is an error."""
        forced = self.forced(h, w).to(tokens.device)
        fixed = forced >= 0
        bad = (tokens[:, fixed] != forced[fixed]).any(1) | (tokens[:, ~fixed] >= self.codebook_size).any(1)
        if bool(bad.any()):
            raise ValueError(f"rows {bad.nonzero().flatten().tolist()} break the Lumina-mGPT image grammar")
        return tokens[:, ~fixed].view(-1, h, w)

    def checkpoint_ids(self, code_ids: Tensor) -> Tensor:
        """(vocab_size,) checkpoint id of each of our ids, given the checkpoint id of each code (K,)."""
        grammar = [self.soi, self.eoi, self.eol] + [self.size_base + g for g in range(self.max_grid + 1)]
        return torch.cat([code_ids.long(), torch.tensor(grammar, dtype=torch.long)])


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint directory


def is_chameleon_dir(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == "chameleon"
    except json.JSONDecodeError:
        return False


def read_config(path: str | Path):
    """transformers' ChameleonConfig of a local directory (never the hub)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import ChameleonConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json: not a transformers Chameleon / Lumina-mGPT directory")
    if not is_chameleon_dir(path):
        raise CheckpointError(f"{path / 'config.json'}: model_type is not 'chameleon'")
    return ChameleonConfig.from_pretrained(str(path), local_files_only=True)


def weight_files(path: str | Path) -> dict[str, Path]:
    """{tensor name: shard file} from model.safetensors.index.json, or every key of model.safetensors."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in wm.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


class _Shards:
    """Reads tensors by name across the shards, keeping one file open at a time."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.open, self.handle = files, None, None

    def __contains__(self, key):
        return key in self.files

    def shape(self, key) -> tuple:
        return tuple(self._file(key).get_slice(key).get_shape())

    def get(self, key) -> Tensor:
        return self._file(key).get_tensor(key)

    def _file(self, key):
        from safetensors import safe_open

        if key not in self.files:
            raise CheckpointError(f"tensor {key!r} not found in {sorted({str(f) for f in self.files.values()})}")
        if self.open != self.files[key]:
            self.open, self.handle = self.files[key], safe_open(str(self.files[key]), "pt")
        return self.handle


def code_token_ids(hf_config, grammar: LuminaGrammar) -> Tensor:
    """(K,) checkpoint id of each VQ code: from the config's vocabulary_map ("IMGIMG" + code digits written as
    letters A..J + "Z", the Chameleon convention) when present, else code + grammar.image_token_offset."""
    vmap = getattr(hf_config, "vocabulary_map", None)
    K = grammar.codebook_size
    if not vmap:
        return torch.arange(K) + grammar.image_token_offset
    ids = torch.full((K,), -1, dtype=torch.long)
    digits = {chr(ord("A") + i): str(i) for i in range(10)}
    for name, tok in vmap.items():
        if name.startswith("IMGIMG") and name.endswith("Z"):
            code = int("".join(digits.get(c, c) for c in name[len("IMGIMG"):-1]))
            if code < K:
                ids[code] = tok
    if bool((ids < 0).any()):
        raise CheckpointError(f"config.json vocabulary_map names {int((ids >= 0).sum())} image tokens, "
                              f"the grammar needs {K}")
    return ids


def chameleon_gpt_config(hf_config, grid: tuple[int, int], prompt_len: int, grammar: LuminaGrammar,
                         path: str | Path = "") -> GPTConfig:
    """Our GPTConfig for a ChameleonConfig and a token grid (h, w)."""
    h, w = grid
    where = f"{Path(path) / 'config.json'}"
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise CheckpointError(f"{where}: attention_bias / mlp_bias = true is not a Chameleon-7B layout")
    need = max(grammar.soi, grammar.eoi, grammar.eol, grammar.size_base + max(h, w))
    if hf_config.vocab_size <= need:
        raise CheckpointError(f"{where}: vocab_size {hf_config.vocab_size} cannot hold Lumina-mGPT's image grammar "
                              f"(token ids up to {need} for a {h}x{w} grid; Lumina-mGPT / Chameleon have 65536)")
    if hf_config.vq_config.num_embeddings != grammar.codebook_size:
        raise CheckpointError(f"{where}: vq_config.num_embeddings {hf_config.vq_config.num_embeddings} != the "
                              f"grammar's codebook size {grammar.codebook_size}")
    rope = hf_config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{where}: rope_type {rope.get('rope_type')!r} is not supported (default only)")
    T = grammar.sequence_length(h, w)
    return GPTConfig(
        dim=hf_config.hidden_size, n_layer=hf_config.num_hidden_layers, n_head=hf_config.num_attention_heads,
        n_kv_head=hf_config.num_key_value_heads, intermediate_size=hf_config.intermediate_size,
        rope_base=float(rope.get("rope_theta", 10000.0)), norm_eps=hf_config.rms_norm_eps,
        model_type="lm", arch="chameleon", qk_norm=True, swin_norm=bool(hf_config.swin_norm),
        vocab_size=grammar.vocab_size, text_vocab_size=hf_config.vocab_size, free_vocab=grammar.codebook_size,
        cls_token_num=prompt_len, block_size=T, class_dropout_prob=0.0)


def import_chameleon(path: str | Path, image_size: int = 768, downsample: int = 16, prompt_len: int = 128,
                     grammar: LuminaGrammar = LuminaGrammar(), dtype: Optional[torch.dtype] = None) -> Transformer:
    """A Lumina-mGPT / Chameleon directory -> our Transformer (eval mode) for images of image_size px.

    Weights are read tensor by tensor (a 7B checkpoint is not held twice); dtype None keeps the checkpoint's.
    The vocabulary is checked three ways (config vocab_size, the embedding's and the head's rows), each error
    naming the file, key and sizes."""
    path = Path(path)
    hf = read_config(path)
    grid = image_size // downsample
    cfg = chameleon_gpt_config(hf, (grid, grid), prompt_len, grammar, path)
    shards = _Shards(weight_files(path))
    prefix = "model." if "model.embed_tokens.weight" in shards else ""
    for key in (f"{prefix}embed_tokens.weight", "lm_head.weight"):
        if key not in shards:
            raise CheckpointError(f"{path}: tensor {key!r} missing: not a ChameleonForConditionalGeneration checkpoint")
        rows, dim = shards.shape(key)
        if (rows, dim) != (hf.vocab_size, hf.hidden_size):
            raise CheckpointError(f"{path}: {key} has shape {(rows, dim)} but config.json says vocab_size "
                                  f"{hf.vocab_size}, hidden_size {hf.hidden_size}: wrong or mixed-up checkpoint")
    ids = grammar.checkpoint_ids(code_token_ids(hf, grammar))
    hd = cfg.head_dim
    perm = rotate_half_permutation(hd)

    def heads(w: Tensor, n: int) -> Tensor:  # rotate-half -> adjacent pairs, per head (rows, or (n, hd) norms)
        return w.reshape(n, hd, *w.shape[1:])[:, perm].reshape(w.shape)

    sd = {"tok_embeddings.weight": shards.get(f"{prefix}embed_tokens.weight"),
          "output.weight": shards.get("lm_head.weight")[ids], "norm.weight": shards.get(f"{prefix}norm.weight"),
          "token_ids": ids}
    for i in range(cfg.n_layer):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        a = src + "self_attn."
        q, k, v = (shards.get(a + f"{n}_proj.weight") for n in "qkv")
        sd[dst + "attention.wqkv.weight"] = torch.cat([heads(q, cfg.n_head), heads(k, cfg.kv_heads), v])
        sd[dst + "attention.wo.weight"] = shards.get(a + "o_proj.weight")
        for n, nh in (("q", cfg.n_head), ("k", cfg.kv_heads)):
            for part in ("weight", "bias"):
                t = shards.get(a + f"{n}_norm.{part}").reshape(nh, hd)
                sd[dst + f"attention.{n}_norm.{part}"] = t[:, perm]
        m = src + "mlp."
        sd[dst + "feed_forward.w1.weight"] = shards.get(m + "gate_proj.weight")
        sd[dst + "feed_forward.w3.weight"] = shards.get(m + "up_proj.weight")
        sd[dst + "feed_forward.w2.weight"] = shards.get(m + "down_proj.weight")
        sd[dst + "attention_norm.weight"] = shards.get(src + "input_layernorm.weight")
        sd[dst + "ffn_norm.weight"] = shards.get(src + "post_attention_layernorm.weight")
    if dtype is not None:
        sd = {k: (t.to(dtype) if t.is_floating_point() else t) for k, t in sd.items()}
    with torch.device("meta"):
        model = Transformer(cfg)
    missing = set(model.state_dict()) - set(sd)
    if missing:
        raise CheckpointError(f"{path}: no source for {sorted(missing)[:6]}")
    model.load_state_dict(sd, strict=True, assign=True)
    model.rope = rope_1d_table(cfg.rope_positions, cfg.head_dim, cfg.rope_base)
    model.causal = torch.ones(0, 0, dtype=torch.bool)
    model.grammar = square_image_grammar(cfg.free_vocab, cfg.block_size)
    if not torch.equal(model.grammar, grammar.forced(grid, grid)):
        raise CheckpointError(f"{path}: the grammar's layout ({grammar}) differs from the model's")
    return model.eval()


def chameleon_codebook(path: str | Path, vqgan: Optional[str | Path] = None) -> Tensor:
    """The VQ-VAE codebook (K, d): `model.vqmodel.quantize.embedding.weight` of the checkpoint when it holds the
    VQ-VAE, else the original Chameleon tokenizer file (`vqgan.ckpt`, read with weights_only=True)."""
    shards = _Shards(weight_files(path))
    key = "model.vqmodel.quantize.embedding.weight"
    if key in shards:
        return shards.get(key).float()
    if vqgan is None:
        raise CheckpointError(f"{path}: no {key} in the checkpoint; pass the Chameleon tokenizer's vqgan.ckpt")
    from lisa.checkpoint import read_state_dict

    sd = read_state_dict(vqgan)
    if "quantize.embedding.weight" not in sd:
        raise CheckpointError(f"{vqgan}: key 'quantize.embedding.weight' missing: not a Chameleon VQGAN checkpoint")
    return sd["quantize.embedding.weight"].float()


def taming_to_ours(sd: dict[str, Tensor], n_levels: int) -> dict[str, Tensor]:
    """A taming-transformers VQGAN state dict (Chameleon's vqgan.ckpt; transformers' `model.vqmodel.*` has the
    same encoder names) -> lisa.models.vq key names. Encoder level i = down.i; decoder conv_blocks[j] = up.(L-1-j)
    (taming lists the up levels by resolution, we in the order they run); mid.block_1 / attn_1 / block_2 = mid.0
    / 1 / 2; resnet `block` = `res`. Keys of the training loss (discriminator, LPIPS) are dropped."""
    import re

    out = {}
    for k, v in sd.items():
        if k.startswith("loss."):
            continue
        k2 = re.sub(r"^encoder\.down\.(\d+)\.block\.", r"encoder.conv_blocks.\1.res.", k)
        k2 = re.sub(r"^encoder\.down\.(\d+)\.(downsample|attn)\.", r"encoder.conv_blocks.\1.\2.", k2)
        m = re.match(r"^decoder\.up\.(\d+)\.(block|attn|upsample)\.(.*)$", k2)
        if m:
            j = n_levels - 1 - int(m.group(1))
            k2 = f"decoder.conv_blocks.{j}.{'res' if m.group(2) == 'block' else m.group(2)}.{m.group(3)}"
        k2 = re.sub(r"^(encoder|decoder)\.mid\.block_1\.", r"\1.mid.0.", k2)
        k2 = re.sub(r"^(encoder|decoder)\.mid\.attn_1\.", r"\1.mid.1.", k2)
        k2 = re.sub(r"^(encoder|decoder)\.mid\.block_2\.", r"\1.mid.2.", k2)
        out[k2] = v
    return out


def import_chameleon_vq(path: str | Path, image_size: int = 768):
    """Chameleon's VQGAN (Lumina-mGPT's image tokenizer: `vqgan.ckpt` of Meta's Chameleon release, read with
    weights_only=True) -> our VQModel, codes (B, h, w) <-> images. Sizes (codebook, channels, levels, blocks) are
    read from the tensors; a checkpoint without the decoder (transformers' `model.vqmodel` has the encoder only)
    is an error that says so."""
    from lisa.checkpoint import load_into, read_state_dict
    from lisa.models.vq import VQModel, vq_config

    path = Path(path)
    if path.is_dir():
        shards = _Shards(weight_files(path))
        sd = {k[len("model.vqmodel."):]: shards.get(k) for k in shards.files if k.startswith("model.vqmodel.")}
    else:
        sd = read_state_dict(path)
    if "quantize.embedding.weight" not in sd:
        raise CheckpointError(f"{path}: key 'quantize.embedding.weight' missing: not a Chameleon VQGAN checkpoint")
    if not any(k.startswith("decoder.") for k in sd):
        raise CheckpointError(f"{path}: the VQGAN has no decoder (transformers keeps only the encoder): pass "
                              f"Chameleon's tokenizer/vqgan.ckpt")
    levels = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.down.")})
    ch = sd["encoder.conv_in.weight"].shape[0]
    mult = [sd[f"encoder.down.{i}.block.0.conv2.weight"].shape[0] // ch for i in levels]
    n_res = len({k.split(".")[4] for k in sd if k.startswith("encoder.down.0.block.")})
    K, d = sd["quantize.embedding.weight"].shape
    cfg = vq_config(codebook_size=K, codebook_embed_dim=d, codebook_l2_norm=False, encoder_ch_mult=mult,
                    decoder_ch_mult=mult, z_channels=sd["encoder.conv_out.weight"].shape[0], ch=ch,
                    num_res_blocks=n_res, level_attn=False, image_size=image_size)
    return load_into(VQModel(cfg), taming_to_ours(sd, len(mult)), path).eval()


def geometry_codebook(codebook: Tensor, vocab_size: int) -> Tensor:
    """The codebook extended to our whole vocabulary: one extra orthogonal direction per grammar token, so no
    grammar token is any code's neighbour by cosine unless the codebook itself is degenerate (and grammar tokens
    never carry probability at code positions anyway)."""
    K, d = codebook.shape
    extra = vocab_size - K
    top = torch.cat([torch.nn.functional.normalize(codebook.float(), dim=-1), torch.zeros(K, extra)], 1)
    bottom = torch.cat([torch.zeros(extra, d), torch.eye(extra)], 1)
    return torch.cat([top, bottom])


# ---------------------------------------------------------------------------------------------------------------
# Prompts and CFG


def prompt_encoder(path: str | Path, prompt_len: int, image_size: int, template: str = PROMPT_TEMPLATE):
    """captions -> (ids (B, prompt_len), mask (B, prompt_len) bool): Lumina-mGPT prompts LEFT padded (the prompt ends
    right before the image), with the tokenizer found in the checkpoint directory (loaded once, here).
    `torch.where(mask, ids, -1)` is the packed form every decode loop and stage takes (Transformer.split_cond)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def encode(captions: list[str]) -> tuple[Tensor, Tensor]:
        ids = torch.zeros(len(captions), prompt_len, dtype=torch.long)
        mask = torch.zeros(len(captions), prompt_len, dtype=torch.bool)
        for i, c in enumerate(captions):
            t = tok(template.format(width=image_size, height=image_size, caption=c),
                    add_special_tokens=True)["input_ids"][:prompt_len]
            ids[i, prompt_len - len(t):] = torch.tensor(t)
            mask[i, prompt_len - len(t):] = True
        return ids, mask

    return encode


def encode_prompts(path: str | Path, captions: list[str], prompt_len: int, image_size: int,
                   template: str = PROMPT_TEMPLATE) -> tuple[Tensor, Tensor]:
    """prompt_encoder(...)(captions), for one call."""
    return prompt_encoder(path, prompt_len, image_size, template)(captions)
