"""The key declarations (actcache.keys) drive one validator for the experiment and train keys."""

from __future__ import annotations

import dataclasses

import pytest

from actcache.config import CacheConfig, VitConfig, experiment_from_dict
from actcache.errors import ConfigError
from actcache.keys import ListOf, declared, key
from actcache.sae.config import GROUP_KEYS, LATE_GROUP_KEYS, LOGISTICS, RUN_KEYS, RunConfig, expand_train_section


def _experiment(**over) -> dict:
    doc = {"vit": {"family": "clip", "ckpt": "org/model", "layers": [-2]}, "data": {"kind": "synthetic", "n_imgs": 4}}
    for path, value in over.items():
        section, _, name = path.rpartition("__")
        (doc[section] if section else doc)[name] = value
    return doc


def test_declaration_gives_type_default_and_required():
    @dataclasses.dataclass(frozen=True)
    class Toy:
        size: int = key(required=True, help="how many", scope="toy", ge=1)
        rate: float | None = key(0.5, "how fast", scope="toy")
        names: tuple[str, ...] = key((), "which", scope="toy")

    decls = declared(Toy)
    assert decls["size"].required and decls["size"].types == (int,)
    assert decls["rate"].types == (float, None) and decls["rate"].default == 0.5
    assert decls["names"].types == (ListOf(str),)


def test_yaml_number_strings_are_accepted_for_numeric_keys():
    (run,) = expand_train_section({"n_tokens": "1e4", "batch_size": "1_000", "lr": "3e-4"}, "x.yaml")
    assert (run.steps, run.batch_size, run.lr) == (10, 1000, 3e-4)
    exp = experiment_from_dict(_experiment(cache={"max_patches_per_shard": "2.4e6"}), "x.yaml")
    assert exp.cache.max_patches_per_shard == 2_400_000 and isinstance(exp.cache.max_patches_per_shard, int)


@pytest.mark.parametrize(
    "train, want",
    [
        (
            {"steps": 10, "saes": [{"k": 4}, {"k": 0}]},
            "x.yaml: train.saes[1]: key 'k' must be >= 1 (or null), got 0; e.g. `k: 32`",
        ),
        (
            {"steps": 10, "eval_frac": 1},
            "x.yaml: train: key 'eval_frac' must be in [0, 1), got 1.0; e.g. `eval_frac: 0.05`",
        ),
        ({"steps": 10, "dtype": "fp8"}, "key 'dtype' must be one of float32, float64, bfloat16, got 'fp8'"),
        ({"steps": 10, "sweep": {"lr": [1e-3, "x"]}}, "x.yaml: train.sweep: key 'lr' must be float, got 'x' (str)"),
        ({"steps": True}, "key 'steps' must be int, got True (bool); e.g. `steps: 1000`"),
    ],
)
def test_bad_train_value_is_one_line_naming_file_key_value_and_fix(train, want):
    with pytest.raises(ConfigError) as err:
        expand_train_section(train, "x.yaml")
    assert want in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "over, want",
    [
        (
            {"vit__ckpt": 3},
            "x.yaml: key 'vit.ckpt' must be str, got 3 (int); e.g. `ckpt: openai/clip-vit-base-patch16`",
        ),
        ({"vit__family": "vitx"}, "x.yaml: key 'vit.family' must be one of clip, siglip, dinov2, dinov3, siglip2, got 'vitx'"),
        ({"vit__layers": [-2, -2]}, "x.yaml: key 'vit.layers' repeats an item, got (-2, -2); e.g. `layers: [-2]`"),
        ({"cache": {"n_workers": -1}}, "x.yaml: key 'cache.n_workers' must be in [0, 256], got -1; e.g. `n_workers: 4`"),
        ({"cache": {"batch_sz": 8}}, "x.yaml: unknown key 'cache.batch_sz'. Did you mean 'cache.batch_size'? Allowed: batch_size, device"),
        ({"name": "my exp"}, "x.yaml: key 'name' must match"),
    ],
)
def test_bad_experiment_value_names_the_nested_key_as_written(over, want):
    with pytest.raises(ConfigError) as err:
        experiment_from_dict(_experiment(**over), "x.yaml")
    assert want in str(err.value) and "\n" not in str(err.value)


def test_sections_are_checked_when_built_directly():
    with pytest.raises(ConfigError, match=r"key 'cache.batch_size' must be >= 1, got 0"):
        CacheConfig(batch_size=0)
    assert VitConfig("clip", "org/model", [3, 1]).layers == (3, 1)


def test_scopes_and_flags_give_the_identity_tables():
    logistics = {n for n, d in RUN_KEYS.items() if d.key.scope in ("logging", "loader")} | {"decode", "batch_saes"}
    assert set(LOGISTICS) == logistics
    assert set(LATE_GROUP_KEYS) == {"n_readers", "cold_read", "batch_timeout_s", "prefetch", "precision", "decode",
                                    "keep_checkpoints", "batch_saes", "verify_reads"}  # fmt: skip
    assert set(GROUP_KEYS) >= {"layer", "patches", "batch_size", "steps", *LOGISTICS}
    assert not set(GROUP_KEYS) & {"lr", "k", "activation", "width"}


def test_one_default_per_key_for_yaml_and_direct_construction():
    (from_yaml,) = expand_train_section({"steps": 1}, "x.yaml")
    assert from_yaml == RunConfig()  # k 32, exp_factor 16: the same truth both ways
    (relu,) = expand_train_section({"steps": 1, "activation": "relu", "l1_coeff": 1e-3, "width": 64}, "x.yaml")
    assert (relu.k, relu.exp_factor) == (None, None)  # keys that do not apply are null
    with pytest.raises(ConfigError, match=r"key 'k' is only for activation topk/batchtopk"):
        expand_train_section({"steps": 1, "activation": "relu", "l1_coeff": 1e-3, "k": 32}, "x.yaml")


def test_workflow_config_is_read_by_the_same_validator():
    from actcache.config import workflow_config_from_dict

    cfg = workflow_config_from_dict({"dump_to": "/c", "runs_to": "/r", "experiments": ["a.yaml"]}, "config.yaml")
    assert cfg.experiments == ("a.yaml",)
    with pytest.raises(ConfigError, match=r"config.yaml: nothing to run; list experiment files under 'experiments'"):
        workflow_config_from_dict({"dump_to": "/c", "runs_to": "/r", "experiments": []}, "config.yaml")
    with pytest.raises(ConfigError, match=r"config.yaml: missing required key 'runs_to'"):
        workflow_config_from_dict({"dump_to": "/c", "experiments": ["a.yaml"]}, "config.yaml")


def test_train_key_typo_names_the_likely_key_not_the_whole_list():
    with pytest.raises(ConfigError) as err:
        expand_train_section({"steps": 10, "log_evry": 5}, "x.yaml")
    msg = str(err.value)
    assert "unknown key 'log_evry'. Did you mean 'log_every'?" in msg and "Allowed" not in msg, msg
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'\. Allowed: activation, "):
        expand_train_section({"steps": 10, "zzz": 5}, "x.yaml")
