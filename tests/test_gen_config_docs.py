"""scripts/gen_config_docs.py: the schemas and README key tables follow the key declarations."""

from __future__ import annotations

import importlib.util
import os
import shutil

import jsonschema
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location(
        "gen_config_docs", os.path.join(ROOT, "scripts", "gen_config_docs.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_schemas_and_tables_match_the_declarations(gen):
    stale = gen.stale(ROOT)
    assert not stale, f"{stale} differ from the key declarations: run python scripts/gen_config_docs.py"


def test_an_edited_table_is_stale_and_regenerated_keeping_the_prose(gen, tmp_path):
    for path in gen.generated(ROOT):
        os.makedirs(tmp_path / os.path.dirname(path), exist_ok=True)
        shutil.copy(os.path.join(ROOT, path), tmp_path / path)
    readme = tmp_path / "config" / "README.md"
    text = readme.read_text().replace("| `lr` | float | `0.0004` |", "| `lr` | float | `0.001` |")
    readme.write_text(text + "\nA closing note.\n")
    assert gen.stale(str(tmp_path)) == ["config/README.md"]
    fixed = gen.generated(str(tmp_path))["config/README.md"]
    assert "| `lr` | float | `0.0004` |" in fixed and fixed.endswith("\nA closing note.\n")


def test_experiment_schema_accepts_the_demo_and_rejects_what_the_validator_rejects(gen):
    schema = yaml.safe_load(gen.generated(ROOT)["workflow/schemas/experiment.schema.yaml"])
    with open(os.path.join(ROOT, "config", "experiments", "demo.yaml")) as fd:
        demo = yaml.safe_load(fd)
    jsonschema.validate(demo, schema)
    jsonschema.validate({**demo, "cache": {"max_patches_per_shard": "2.4e6"}}, schema)  # YAML's number strings
    for bad in ({"vit": {**demo["vit"], "family": "vitx"}}, {"cache": {"n_workers": -1}}, {"trian": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**demo, **bad}, schema)
