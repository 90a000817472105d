"""Identity is unchanged by the key declarations: cache hash, sae_id and group_id of existing configs.

The expected values were computed on the code before the keys were declared with actcache.keys
(FIELDS and RunConfig then gave different defaults for k, exp_factor and steps).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import yaml

from actcache.config import experiment_from_dict
from actcache.errors import ConfigError
from actcache.protocol import Metadata
from actcache.sae.config import RUN_KEYS, RunConfig, expand_train_section, groups

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SWEEP = {
    "layer": -2, "batch_size": 512, "n_tokens": "1e6", "lr": "3e-4",
    "sweep": {"seed": [0, 1]},
    "saes": [
        {"activation": "topk", "exp_factor": 8, "sweep": {"k": [16, 32]}},
        {"activation": "topk", "width": 1024},
        {"activation": "batchtopk", "width": 2048, "k": 64, "k_aux": 256},
        {"activation": "relu", "width": 1024, "sweep": {"l1_coeff": ["1e-4", 1.0e-3]}, "l1_warmup_steps": 10},
        {"activation": "relu", "l1_coeff": 3.0e-4, "normalize_decoder": True},
        {"exp_factor": 16, "n_readers": 2, "cold_read": "fault"},
        {"k": 8, "lr_decay": "cosine", "warmup_steps": 5, "max_grad_norm": None, "batch_timeout_s": None},
    ],
}  # fmt: skip
MISC = [
    {"steps": 10},
    {"steps": 10, "activation": "relu", "l1_coeff": 1e-3},
    {"steps": 10, "width": 256, "exp_factor": 4, "k": 8},
    {"steps": 10, "k": None, "exp_factor": None},
    {
        "steps": 10,
        "patches": "all",
        "scale_norm": True,
        "deterministic": False,
        "eval_cache": "/x",
        "prefetch": "whole",
    },
]


def _demo():
    with open(os.path.join(REPO, "config", "experiments", "demo.yaml")) as fd:
        doc = yaml.safe_load(fd)
    doc["data"]["root"] = "/actcache-demo/images"  # absolute: the hash must not depend on the checkout
    return experiment_from_dict(doc, source="demo.yaml", base_dir="/nonexistent-base")


def _ids(runs):
    return [(r.sae_id, r.group_id) for r in runs]


def test_demo_cache_hash_and_ids_are_unchanged():
    exp = _demo()
    md = Metadata(
        vit_family=exp.vit.family, vit_ckpt=exp.vit.ckpt, layers=tuple(exp.vit.layers), n_patches_per_img=16,
        cls_token=True, d_vit=64, n_imgs=240, max_patches_per_shard=exp.cache.max_patches_per_shard,
        data=exp.data_dict,
    )  # fmt: skip
    assert md.hash == "a16eb444fc98b0a5bd2470fb098317fb27be3a03fbf27084d03459d5518a7e35"
    runs = expand_train_section(exp.train, "demo.yaml", layers=exp.vit.layers)
    assert _ids(runs) == [
        ("92a21d2a43a4", "L-2-image-38c6335e"),  # group ids of non-default logging or loader keys
        ("344d5f1c8e16", "L-2-image-38c6335e"),  # changed once when those keys left the group id
    ]


def test_sweep_over_several_objectives_keeps_its_ids():
    runs = expand_train_section(SWEEP, "s.yaml", layers=(-2,))
    assert _ids(runs) == [
        ("28044ba28cb3", "L-2-image-15f44486"),
        ("9dca8539c58a", "L-2-image-15f44486"),
        ("e07ae3c90787", "L-2-image-15f44486"),
        ("53255e32031c", "L-2-image-15f44486"),
        ("89d980a0ccc3", "L-2-image-15f44486"),
        ("5104512e5e48", "L-2-image-15f44486"),
        ("6dc0402d180e", "L-2-image-15f44486"),
        ("eb158061a60a", "L-2-image-15f44486"),
        ("316748ff8169", "L-2-image-15f44486"),
        ("ae6ef7f7b607", "L-2-image-15f44486"),
        ("230279dda7d1", "L-2-image-15f44486"),
        ("7cc7111e477b", "L-2-image-15f44486"),
        ("49b05cc7b0a5", "L-2-image-15f44486"),
        ("dc4550bc9b10", "L-2-image-15f44486"),
        ("0191aeb39da0", "L-2-image-15f44486"),  # loader keys (n_readers, batch_timeout_s) are
        ("0d0386834939", "L-2-image-15f44486"),  # not part of a group's id: one group, which then
        ("dcc5be0f37be", "L-2-image-15f44486"),  # refuses the disagreement (test below)
        ("08f60050c56e", "L-2-image-15f44486"),
    ]


def test_defaults_resolved_per_key_keep_ids():
    # k null for relu, exp_factor null beside a width, the default 16 / 32 otherwise
    runs = [r for train in MISC for r in expand_train_section(train, "m.yaml")]
    assert _ids(runs) == [
        ("37765c028eea", "Lauto-image-4b8ad8d2"),
        ("e09f12921ccc", "Lauto-image-4b8ad8d2"),
        ("da60d01669ed", "Lauto-image-4b8ad8d2"),
        ("37765c028eea", "Lauto-image-4b8ad8d2"),
        ("2efce78bcb25", "Lauto-all-1460c11e"),
    ]
    direct = [RunConfig(), RunConfig(activation="relu", l1_coeff=1e-3, steps=5)]
    assert _ids(direct) == [
        ("fd273e09c2f9", "Lauto-image-6cde478e"),
        ("8a3456de9708", "Lauto-image-611000f5"),
    ]


def test_every_resolved_value_is_unchanged():
    exp = _demo()
    runs = [r for t in [exp.train, SWEEP, *MISC] for r in expand_train_section(t, "m.yaml")]
    # keys added later (at their defaults here) are left out: the pin predates them
    later = {"jumprelu_bandwidth", "jumprelu_init_threshold", "matryoshka_prefixes", "l0_coeff", "preact_coeff",
             "matryoshka_weights", "l0_warmup_steps", "precision", "decode",
             "keep_checkpoints", "batch_saes", "verify_reads", "enc_init", "dec_init_frac", "jumprelu_aux_coeff",
             "aux_tokens"}  # fmt: skip
    assert all(getattr(r, k) == RUN_KEYS[k].default for r in runs for k in later)
    blob = json.dumps([{k: v for k, v in r.to_dict().items() if k not in later} for r in runs], sort_keys=True).encode()
    assert hashlib.sha256(blob).hexdigest() == "b40696bd67a874e921384d7ffb40177c877122e75a9872d9bc805dfb56b1b443"


def test_logging_and_loader_keys_leave_group_id_and_sae_id_alone():
    base = RunConfig(steps=10)
    for edit in ({"log_every": 7}, {"ckpt_every": 9}, {"n_readers": 2}, {"prefetch": "whole"}):
        other = RunConfig(steps=10, **edit)
        assert (other.sae_id, other.group_id) == (base.sae_id, base.group_id), edit
    assert RunConfig(steps=11).group_id != base.group_id  # a data key still makes a new group


def test_one_group_with_two_loader_settings_is_refused_naming_the_key():
    runs = expand_train_section(SWEEP, "s.yaml", layers=(-2,))
    with pytest.raises(ConfigError, match=r"'n_readers' to None and 2; it is one value per group"):
        groups(runs)


def test_enc_init_enters_ids_only_when_set_and_only_for_topk_variants():
    (default,) = expand_train_section({"steps": 10}, "x.yaml")
    (fit,) = expand_train_section({"steps": 10, "enc_init": "fit"}, "x.yaml")
    (tied,) = expand_train_section({"steps": 10, "enc_init": "tied"}, "x.yaml")
    assert default.sae_id == RunConfig(steps=10).sae_id  # ids issued before the key stay
    assert len({default.sae_id, fit.sae_id, tied.sae_id}) == 3 and tied.group_id == default.group_id
    assert (default.encoder_init, fit.encoder_init, tied.encoder_init) == ("fit", "fit", "tied")
    (relu,) = expand_train_section({"steps": 10, "activation": "relu", "l1_coeff": 1e-3}, "x.yaml")
    assert relu.encoder_init == "tied"
    with pytest.raises(ConfigError, match=r"x\.yaml.*key 'enc_init' is only for activation topk.*not relu"):
        expand_train_section({"steps": 10, "activation": "relu", "l1_coeff": 1e-3, "enc_init": "tied"}, "x.yaml")


def test_dec_init_frac_enters_ids_only_when_set_and_only_for_topk_variants():
    (default,) = expand_train_section({"steps": 10}, "x.yaml")
    (quarter,) = expand_train_section({"steps": 10, "dec_init_frac": 0.25}, "x.yaml")
    (none,) = expand_train_section({"steps": 10, "dec_init_frac": 0}, "x.yaml")
    assert default.sae_id == RunConfig(steps=10).sae_id  # ids issued before the key stay
    assert len({default.sae_id, quarter.sae_id, none.sae_id}) == 3 and none.group_id == default.group_id
    assert (default.decoder_data_frac, quarter.decoder_data_frac, none.decoder_data_frac) == (0.25, 0.25, 0.0)
    (relu,) = expand_train_section({"steps": 10, "activation": "relu", "l1_coeff": 1e-3}, "x.yaml")
    assert relu.decoder_data_frac == 0.0
    with pytest.raises(ConfigError, match=r"x\.yaml.*key 'dec_init_frac' is only for activation topk.*not relu"):
        expand_train_section({"steps": 10, "activation": "relu", "l1_coeff": 1e-3, "dec_init_frac": 0.5}, "x.yaml")
    with pytest.raises(ConfigError, match=r"dec_init_frac"):
        expand_train_section({"steps": 10, "dec_init_frac": 2}, "x.yaml")


def test_auxk_keys_enter_ids_only_when_set_and_only_where_there_is_an_auxk_term():
    jr = {"steps": 10, "activation": "jumprelu", "l0_coeff": 1e-2}
    (default,) = expand_train_section(jr, "x.yaml")
    (same,) = expand_train_section({**jr, "jumprelu_aux_coeff": 1.0}, "x.yaml")
    (off,) = expand_train_section({**jr, "jumprelu_aux_coeff": 0}, "x.yaml")
    (wide,) = expand_train_section({**jr, "aux_tokens": 65536}, "x.yaml")
    assert default.sae_id == same.sae_id == RunConfig(**jr, k=None).sae_id  # ids issued before the keys stay
    assert len({default.sae_id, off.sae_id, wide.sae_id}) == 3
    kw = default.objective_kwargs()
    assert (kw["aux_coeff"], kw["aux_tokens"]) == (1.0, None) and off.objective_kwargs()["aux_coeff"] == 0
    (topk,) = expand_train_section({"steps": 10}, "x.yaml")
    (topk_w,) = expand_train_section({"steps": 10, "aux_tokens": 4096}, "x.yaml")
    assert topk.sae_id == RunConfig(steps=10).sae_id != topk_w.sae_id and topk_w.objective_kwargs()["aux_tokens"] == 4096
    with pytest.raises(ConfigError, match=r"x\.yaml.*key 'jumprelu_aux_coeff' is only for .*jumprelu"):
        expand_train_section({"steps": 10, "jumprelu_aux_coeff": 0.5}, "x.yaml")
    with pytest.raises(ConfigError, match=r"x\.yaml.*key 'aux_tokens' is only for .*AuxK.*not relu"):
        expand_train_section({"steps": 10, "activation": "relu", "l1_coeff": 1e-3, "aux_tokens": 100}, "x.yaml")
    with pytest.raises(ConfigError, match=r"aux_tokens"):
        expand_train_section({**jr, "aux_tokens": 0}, "x.yaml")


def test_a_removed_key_says_what_replaced_it():
    jr = {"steps": 10, "activation": "jumprelu", "l0_coeff": 1e-2}
    for doc in ({**jr, "revive_coeff": 0.01}, {**jr, "saes": [{"revive_coeff": 0.01}]},
                {**jr, "sweep": {"revive_coeff": [0.01]}}):  # fmt: skip
        with pytest.raises(ConfigError, match=r"x\.yaml.*key 'revive_coeff' was removed: .*jumprelu_aux_coeff.*delete"):
            expand_train_section(doc, "x.yaml")
