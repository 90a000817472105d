"""No damaged metadata.json, shards.json or experiment YAML gives a traceback or a hang: the CLI
answers with exit status 1 (invalid cache) or 2 (a one-line error naming the file), and the
library raises only ActCacheError. Hypothesis draws the damage (scripts/fuzzlib.py makes it);
scripts/chaos.py runs the same cases by the hundred.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import fuzzlib  # noqa: E402

from actcache.docfiles import MAX_DEPTH  # noqa: E402

FUZZ = settings(max_examples=20, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return fuzzlib.make_cache(str(tmp_path_factory.mktemp("pristine")))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    ckpt = fuzzlib.make_checkpoint_config(str(tmp_path_factory.mktemp("ckpt")))
    fuzzlib.warm_up(ckpt, None, str(tmp_path_factory.mktemp("warm")))
    return ckpt


@FUZZ
@given(seed=st.integers(0, 2**32 - 1))
def test_damaged_cache_files_give_a_verdict_or_one_line_never_a_traceback(pristine, tmp_path, seed):
    kind, failures = fuzzlib.fuzz_cache_case(pristine, str(tmp_path / "w"), random.Random(seed), loaders=False)
    assert not failures, (kind, failures)


@FUZZ
@given(doc=json_values, target=st.sampled_from(["metadata.json", "shards.json"]))
def test_any_json_document_in_a_cache_gives_a_verdict_never_a_traceback(pristine, tmp_path, doc, target):
    work = tmp_path / "j"
    failures = []
    try:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        cache_dir = work / os.path.basename(pristine)
        shutil.copytree(pristine, cache_dir)
        (cache_dir / target).write_text(json.dumps(doc))
        failures = fuzzlib.check_cache(str(cache_dir), loaders=target == "metadata.json")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert not failures, failures


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(seed=st.integers(0, 2**32 - 1))
def test_damaged_experiment_yaml_gives_one_line_never_a_traceback(ckpt, tmp_path, seed):
    kind, failures = fuzzlib.fuzz_experiment_case(ckpt, str(tmp_path / "w"), random.Random(seed))
    assert not failures, (kind, failures)


def _plan(path, tmp_path) -> tuple[int, str]:
    argv = ["plan", "--experiment", str(path), "--dump-to", str(tmp_path / "c"), "--runs-to", str(tmp_path / "r")]
    with fuzzlib.no_slurm():
        rc, _, err = fuzzlib.run_cli(argv)
    assert fuzzlib.judge(argv, rc, err) is None, err
    return rc, err


def test_latin1_experiment_says_it_is_not_utf8_and_names_the_line(ckpt, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(fuzzlib.EXPERIMENT.format(ckpt=ckpt).replace("fuzzed", "caf\xe9").encode("latin-1"))
    rc, err = _plan(path, tmp_path)
    assert rc == 2 and f"{path}: not UTF-8 text (byte 0xe9 at line 1); save the experiment file as UTF-8" in err


def test_deeply_nested_yaml_and_json_are_refused_by_their_depth(ckpt, tmp_path, pristine):
    path = tmp_path / "exp.yaml"
    path.write_text(fuzzlib.EXPERIMENT.format(ckpt=ckpt) + "extra: " + "[" * 5000 + "]" * 5000 + "\n")
    rc, err = _plan(path, tmp_path)
    assert rc == 2 and f"nested more than {MAX_DEPTH} levels deep" in err
    import shutil

    cache_dir = tmp_path / os.path.basename(pristine)
    shutil.copytree(pristine, cache_dir)
    (cache_dir / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)
    rc, out, _ = fuzzlib.run_cli(["verify", str(cache_dir)])
    assert rc == 1 and f"nested more than {MAX_DEPTH} levels deep" in out


def test_data_kind_written_as_a_list_is_a_config_error(ckpt, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(fuzzlib.EXPERIMENT.format(ckpt=ckpt).replace("kind: synthetic", "kind: [synthetic]"))
    rc, err = _plan(path, tmp_path)
    assert rc == 2 and "data.kind must be one of" in err and "['synthetic']" in err


def test_a_fifo_in_place_of_metadata_is_refused_without_waiting(pristine, tmp_path):
    import shutil

    cache_dir = tmp_path / os.path.basename(pristine)
    shutil.copytree(pristine, cache_dir)
    os.unlink(cache_dir / "metadata.json")
    os.mkfifo(cache_dir / "metadata.json")
    rc, out, err = fuzzlib.run_cli(["verify", str(cache_dir)], hang_s=10)
    assert rc == 1 and "metadata.json: not a regular file" in out
    rc, _, err = fuzzlib.run_cli(["hash", str(cache_dir / "metadata.json")], hang_s=10)
    assert rc == 2 and err.count("\n") == 1 and "not a regular file" in err


def test_exit_status_is_0_for_a_valid_cache_1_for_an_invalid_one_2_for_a_usage_error(pristine, tmp_path):
    assert fuzzlib.run_cli(["verify", pristine])[0] == 0
    assert fuzzlib.run_cli(["verify", str(tmp_path / "missing")])[0] == 1
    assert fuzzlib.run_cli(["plan", "--experiment", str(tmp_path / "missing.yaml")])[0] == 2
    assert fuzzlib.run_cli(["verify"])[0] == 2  # argparse: a usage error


def test_files_past_the_size_bound_and_absurd_shard_counts_are_refused(ckpt, tmp_path):
    from actcache.docfiles import MAX_DOC_BYTES
    from actcache.protocol import MAX_SHARDS

    path = tmp_path / "exp.yaml"
    path.write_bytes(fuzzlib.EXPERIMENT.format(ckpt=ckpt).encode() + b"#" * MAX_DOC_BYTES)
    rc, err = _plan(path, tmp_path)
    assert rc == 2 and f"more than the {MAX_DOC_BYTES // 2**20} MiB allowed for the experiment file" in err
    path.write_text(fuzzlib.EXPERIMENT.format(ckpt=ckpt).replace("n_imgs: 8", "n_imgs: 999999999999999999999"))
    rc, err = _plan(path, tmp_path)
    assert rc == 2 and f"more than the {MAX_SHARDS:,} actcache handles" in err
