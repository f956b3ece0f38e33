"""Caption encoders from local directories only: the built-in MiniLM, and LlamaGen-T2I's T5 path (a tiny random
T5 in the same transformers format), left-padded to LlamaGen's prefix with its mask, driving a t2i target."""
import pytest
import torch

from lisa.data.text import CaptionEncoder, minilm_path
from tests.helpers import make_tiny_t5


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    return make_tiny_t5(tmp_path_factory.mktemp("t5"))


def test_t5_prefix_is_left_padded_with_its_mask(tiny_t5):
    from transformers import T5EncoderModel

    enc = CaptionEncoder(tiny_t5)
    assert enc.is_t5 and enc.dim == 16
    caps = ["a red apple on a table", "cat"]
    feats, mask = enc.encode_t5(caps, length=12)
    assert feats.shape == (2, 12, 16) and mask.shape == (2, 12) and mask.dtype == torch.bool
    model = T5EncoderModel.from_pretrained(str(tiny_t5), local_files_only=True).eval()
    for i, c in enumerate(caps):
        ids = enc.tokenizer([c], return_tensors="pt")
        n = ids["input_ids"].shape[1]
        assert mask[i].tolist() == [False] * (12 - n) + [True] * n  # real tokens last (LlamaGen's left padding)
        with torch.no_grad():
            ref = model(**ids).last_hidden_state[0]
        assert torch.allclose(feats[i, 12 - n :], ref, atol=1e-5) and (feats[i, : 12 - n] == 0).all()
    right, rmask = enc.encode_t5(caps, length=12, left_pad=False)
    assert rmask[1].tolist()[:2] == [True, True] and not rmask[1, -1]


def test_t5_features_drive_a_t2i_target_with_cfg(tiny_t5):
    from lisa.decoding.generate import generate
    from lisa.models.gpt import Transformer, gpt_config
    from lisa.decoding.sampling import SamplingConfig

    enc = CaptionEncoder(tiny_t5)
    feats, mask = enc.encode_t5(["a blue car", "a dog on grass"], length=12)
    torch.manual_seed(0)
    target = Transformer(gpt_config("GPT-micro", vocab_size=64, block_size=16, model_type="t2i", caption_dim=16,
                                    cls_token_num=12)).eval()
    s = SamplingConfig(1.0, 0, 1.0, 3.0)
    tokens, _ = generate(target, feats, s, torch.Generator().manual_seed(0), cond_mask=mask)
    again, _ = generate(target, feats, s, torch.Generator().manual_seed(0), cond_mask=mask)
    assert tokens.shape == (2, 16) and torch.equal(tokens, again)


def test_a_directory_without_a_model_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        CaptionEncoder(tmp_path)
