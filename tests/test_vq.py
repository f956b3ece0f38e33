"""VQ tokenizer: shapes, the normalised codebook, fp32 lookup, encode/decode round trip on codes."""
import torch
import torch.nn.functional as F

from lisa.models.vq import VQModel, vq_config


def test_encode_decode_shapes_and_codebook():
    vq = VQModel(vq_config("VQ-micro")).eval()
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    codes = vq.encode(images)
    assert codes.shape == (2, 4, 4) and codes.dtype == torch.long and codes.max() < 64
    assert vq.decode(codes).shape == (2, 3, 16, 16)
    assert vq.decode(codes.flatten(1)).shape == (2, 3, 16, 16)
    torch.testing.assert_close(vq.codebook().norm(dim=-1), torch.ones(64))


def test_lookup_is_nearest_normalised_code():
    vq = VQModel(vq_config("VQ-micro")).eval()
    z = torch.randn(1, 8, 3, 3)
    codes = vq.quantize.lookup(z)
    zn = F.normalize(z.permute(0, 2, 3, 1), dim=-1)
    expect = (zn @ vq.codebook().T).argmax(-1)  # nearest on the sphere = largest cosine
    assert torch.equal(codes, expect)
    # decoding codes and re-quantising the latents gives back the same codes
    assert torch.equal(vq.quantize.lookup(vq.quantize.embed(codes)), codes)


def test_lookup_runs_in_fp32_under_autocast():
    vq = VQModel(vq_config("VQ-micro")).eval()
    z = torch.randn(2, 8, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes = vq.quantize.lookup(z)
    assert torch.equal(codes, vq.quantize.lookup(z))


def test_presets_grid():
    assert vq_config("VQ-16").downsample == 16 and vq_config("VQ-16").grid_size == 16
    tiny = vq_config("VQ-tiny")
    assert (tiny.grid_size, tiny.codebook_size, tiny.codebook_embed_dim) == (8, 1024, 8)
