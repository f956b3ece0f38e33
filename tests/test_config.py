"""params.yaml is loaded strictly: unknown or mistyped keys are errors naming the key and the section."""
from pathlib import Path

import pytest
import yaml

from lisa.config import ConfigError, profile_text
from lisa.stages.params import load_params, parse_params  # the schema, then what only the code checks
from lisa.decoding.sampling import sampling_config

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


@pytest.mark.parametrize("where", ["sample", "bench_spec", "table"])
def test_verifier_option_typo_fails_at_load(where):
    """A typo in a method's options (lantern's `k` spelled `kk`) is an error at load naming the key and the verifier."""
    raw = micro()
    bad = {"method": "lantern", "options": {"kk": 3}}
    if where == "sample":
        raw["sample"].update(bad)
    elif where == "bench_spec":
        raw["bench_spec"]["methods"].append({"name": "typo", **bad})
    else:
        raw["table"]["cells"]["typo"] = bad
    with pytest.raises(ConfigError, match=rf"'options' in section '{where}.*lantern.*unknown options \['kk'\]"):
        parse_params(raw)


def test_method_typo_fails_at_load():
    raw = micro()
    raw["bench_spec"]["methods"].append({"name": "typo", "method": "lanterne"})
    with pytest.raises(ConfigError, match=r"'method' in section 'bench_spec.methods.*'lanterne'.*not 'vanilla'"):
        parse_params(raw)
    raw = micro()
    raw["sample"]["tree"] = "dinamic"
    with pytest.raises(ConfigError, match="bad value for 'tree' in section 'sample'"):
        parse_params(raw)


def test_named_drafters_are_checked_at_load():
    """A method's drafter is release, lid or a key of drafters.named; a run names a world and a named drafter, under
    the key <world>-<drafter> (its stage's name)."""
    raw = micro()
    parse_params(raw)  # the micro profile's scoreboard family drafts with its named drafter `cfg`
    raw["table"]["cells"]["typo"] = {"method": "exact", "drafter": "cheep"}
    with pytest.raises(ConfigError, match=r"'drafter' in section 'table.cells.typo'.*'cheep'.*drafters.named \['cfg'\]"):
        parse_params(raw)
    raw = micro()
    raw["drafters"]["named"]["lid"] = {"ffn_dim": 0}
    with pytest.raises(ConfigError, match=r"section 'drafters.named': \['lid'\] name the drafters of train-drafter"):
        parse_params(raw)
    for run, match in (({"world": "mars", "drafter": "cfg"}, "unknown world 'mars'"),
                       ({"world": "fashion-c2i", "drafter": "cheep"}, "no drafter 'cheep'"),
                       ({"world": "emoji-t2i", "drafter": "cfg"}, "key must be <world>-<drafter>: emoji-t2i-cfg")):
        raw = micro()
        raw["drafters"]["runs"]["fashion-c2i-cfg"] = run
        with pytest.raises(ConfigError, match=rf"section 'drafters.runs.fashion-c2i-cfg'.*{match}"):
            parse_params(raw)


def resolved(params) -> dict:
    """(section path, world) -> the SamplingConfig that section samples with in that world."""
    from lisa.config import sampling_sections

    out = {}
    for path in sampling_sections():
        section = params
        for key in path:
            section = getattr(section, key)
        for name, world in params.worlds.items():
            out[".".join(path), name] = sampling_config(world, section)
    return out


@pytest.mark.parametrize("profile", ["params.yaml", "micro", "real"])
def test_sampling_sections_resolve_as_before(profile):
    """Every sampling section of params.yaml and the profiles samples with the top-level `sampling` values (the
    sections no longer repeat them; a world's own `sampling` over both), and still does when a section leaves out
    whatever value equals the top-level one."""
    from lisa.config import sampling_sections

    raw = yaml.safe_load((ROOT / profile).read_text() if profile.endswith(".yaml") else profile_text(profile))
    now = resolved(parse_params(raw))
    top = raw["sampling"]
    for (section, world), s in now.items():
        own = raw
        for key in section.split("."):
            own = own.get(key) or {}
        want = top | {k: v for k, v in own.items() if k in top} | (raw["worlds"][world].get("sampling") or {})
        assert (s.temperature, s.top_k, s.top_p, s.cfg_scale) == tuple(want[k] for k in
                                                                         ("temperature", "top_k", "top_p", "cfg_scale"))
    inherited = yaml.safe_load(yaml.safe_dump(raw))
    for path in sampling_sections():
        section = inherited
        for key in path:
            section = section[key]
        for key, value in raw["sampling"].items():
            if section.get(key) == value:
                del section[key]
    assert resolved(parse_params(inherited)) == now


def test_sampling_default_section_and_world_order():
    """A section's own value wins over the top-level `sampling`, which fills what the section leaves out (a section
    left out entirely inherits it all); a world's `sampling` is over both."""
    raw = micro()
    raw["sampling"] = {"temperature": 0.5, "top_k": 3, "top_p": 0.8, "cfg_scale": 5.0}
    for key in ("temperature", "top_k", "top_p", "cfg_scale"):
        raw["sample"].pop(key, None)
    raw["evaluate"]["cfg_scale"] = 6.0
    raw["evaluate"]["top_k"] = 16
    del raw["table"]
    raw["worlds"]["fashion-c2i"]["sampling"] = {"top_k": 7}
    p = parse_params(raw)
    fashion, emoji = p.world("fashion-c2i"), p.world("emoji-t2i")
    assert (p.sample.temperature, p.sample.top_k, p.sample.top_p, p.sample.cfg_scale) == (0.5, 3, 0.8, 5.0)
    assert (p.evaluate.cfg_scale, p.evaluate.top_k, p.table.top_k) == (6.0, 16, 3)
    assert sampling_config(fashion, p.evaluate).top_k == 7 and sampling_config(emoji, p.evaluate).top_k == 16
    raw["worlds"]["fashion-c2i"]["sampling"] = {"cfg": 1.0}
    with pytest.raises(ConfigError, match="unknown keys"):
        parse_params(raw)
    raw = micro()
    raw["sampling"]["tmperature"] = 1.0
    with pytest.raises(ConfigError, match="unknown key 'tmperature' in section 'sampling'"):
        parse_params(raw)


@pytest.mark.parametrize("path,value,match", [
    ("train_drafter.steps", -5, r"'steps' in section 'train_drafter'.*greater than or equal to 1"),
    ("train_drafter.batch_size", 0, r"'batch_size' in section 'train_drafter'"),
    ("sample.per_class", True, r"'per_class' in section 'sample'.*valid integer"),
    ("sample.per_class", -1, r"'per_class' in section 'sample'"),
    ("sample.batch_size", 0, r"'batch_size' in section 'sample'"),
    ("sample.cfg_scale", -2.0, r"'cfg_scale' in section 'sample'"),
    ("calibrate.positions", -1, r"'positions' in section 'calibrate'"),
    ("calibrate.budget_quantile", 1.5, r"'budget_quantile' in section 'calibrate'.*less than or equal to 1"),
    ("cache_logits.max_sequences", 0, r"'max_sequences' in section 'cache_logits'"),
    ("cache_logits.shard_size", 0, r"'shard_size' in section 'cache_logits'"),
    ("cache_logits.K", 100_000, r"section 'cache_logits': K 100000 is above world .* vocabulary"),
    ("table.cells.sjd", {"method": "sjd", "window": 0}, r"'window' in section 'table.cells.sjd'"),
    ("worlds.fashion-c2i.target.n_layer", -1, r"worlds.fashion-c2i.target"),
])
def test_sizes_and_counts_are_checked_at_load(path, value, match):
    """A count below 1 (or 0 where 0 means none), a bool where a count belongs, a share outside [0, 1] or a top-K
    above the vocabulary is an error at load naming the key and section, not an untrained model or a traceback."""
    raw = micro()
    node = raw
    *parents, key = path.split(".")
    for k in parents:
        node = node.setdefault(k, {})
    node[key] = value
    with pytest.raises(ConfigError, match=match):
        parse_params(raw)


def test_one_seed_rule():
    from lisa.config import seed_for
    assert seed_for(0, 5) == 5 and seed_for(3, 2 * 7919 + 1) == 3 * 1_000_003 + 2 * 7919 + 1


def test_methods_become_trees_where_the_loop_lives():
    from lisa.config import DecodeMethod
    from lisa.decoding.generate import SpecConfig
    from lisa.decoding.methods import method_spec, tree_spec
    assert method_spec(DecodeMethod()) is None and method_spec(DecodeMethod(method="sjd")) is None
    m = DecodeMethod(method="exact", tree="dynamic", draft="sample", branching=[3, 1])
    assert method_spec(m) == SpecConfig("exact", "dynamic", 4, 4, 16, "sample", "wor", (3, 1))
    with pytest.raises(ValueError, match="auto"):
        tree_spec(DecodeMethod(method="exact", tree="auto"), "exact")
