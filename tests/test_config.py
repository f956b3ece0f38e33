"""params.yaml is loaded strictly: unknown or mistyped keys are errors naming the key and the section."""
from pathlib import Path

import pytest
import yaml

from lisa.config import ConfigError, load_params, parse_params, profile_text

ROOT = Path(__file__).resolve().parents[1]


def micro() -> dict:
    return yaml.safe_load(profile_text("micro"))


def test_repo_params_and_profiles_load():
    p = load_params(ROOT / "params.yaml")
    assert set(p.worlds) == {"fashion-c2i", "emoji-t2i"} and p.bench.target["preset"] == "GPT-B"
    assert parse_params(micro()).sample.per_class == 2


def test_unknown_key_names_key_and_section():
    raw = micro()
    raw["sample"]["tmperature"] = 1.0
    with pytest.raises(ConfigError, match="unknown key 'tmperature' in section 'sample'"):
        parse_params(raw)


def test_unknown_section():
    raw = micro()
    raw["samples"] = {}
    with pytest.raises(ConfigError, match="unknown key 'samples'"):
        parse_params(raw)


def test_mistyped_value_names_key():
    raw = micro()
    raw["bench"]["repeats"] = "three"
    with pytest.raises(ConfigError, match="bad value for 'repeats' in section 'bench'"):
        parse_params(raw)


def test_bad_model_field_names_world_section():
    raw = micro()
    raw["worlds"]["fashion-c2i"]["target"]["n_layers"] = 4
    with pytest.raises(ConfigError, match=r"worlds.fashion-c2i.target.*n_layers"):
        parse_params(raw)


def test_target_and_tokenizer_must_agree():
    raw = micro()
    raw["worlds"]["fashion-c2i"]["target"]["vocab_size"] = 128
    with pytest.raises(ConfigError, match="vocab_size 128 != tokenizer codebook_size 64"):
        parse_params(raw)


def test_missing_file_and_unknown_profile(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "params.yaml")
    with pytest.raises(ConfigError, match="unknown profile"):
        profile_text("huge")
