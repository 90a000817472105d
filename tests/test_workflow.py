"""The Snakemake workflow with profiles/local: dry runs, a full run, reruns, lint, bad configs."""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from tests.browser import DevTools
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import REPO, TWO_AT_A_TIME, dump_ranges, job_counts, snakemake, write_project

from actcache import ActivationCache
from actcache.protocol import shard_name

N_IMGS = 40  # 10 images per shard with the budget below -> 4 shards


def experiment(ckpt: str, **over) -> dict:
    doc = {
        "name": "wf",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2, -1]},
        "data": {"kind": "synthetic", "n_imgs": N_IMGS, "seed": 1, "size": 40},
        "cache": {"max_patches_per_shard": 10 * 17 * 2, "batch_size": 8, "n_workers": 0, "shards_per_job": 1},
        # two TopK SAEs in one group (one loader pass); layer -1 is in every layers list used below
        "train": {
            "layer": -1,
            "batch_size": 64,
            "steps": 12,
            "buffer_bytes": 1 << 20,
            "eval_frac": 0.1,
            "eval_tokens": 512,
            "exp_factor": 2,
            "dead_tokens": 512,
            "log_every": 4,
            "ckpt_every": 6,
            "sweep": {"k": [4, 8]},
        },
    }
    for k, v in over.items():
        doc[k] = v
    return doc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-clip"), "clip")


@pytest.fixture(scope="module")
def done_project(tmp_path_factory, ckpt):
    """A project whose workflow ran to the end once (profiles/local)."""
    root = str(tmp_path_factory.mktemp("proj"))
    cfg = write_project(root, {"wf": experiment(ckpt)})
    proc = snakemake(cfg, *TWO_AT_A_TIME)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, cfg


@pytest.fixture(scope="module")
def report_html(done_project):
    """`snakemake --report report.html` of the finished project."""
    root, cfg = done_project
    report = os.path.join(root, "report.html")
    proc = snakemake(cfg, "--report", report)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return report


def plan_json(cfg: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "actcache.cli", "plan", "--config", cfg, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(cfg),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_fresh_root_dry_run_lists_every_dump_job(tmp_path, ckpt):
    cfg = write_project(str(tmp_path), {"wf": experiment(ckpt)})
    proc = snakemake(cfg, "-n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    want = {"dump": 4, "gather": 1, "train": 1, "trained": 2, "evaluated": 2, "report": 2, "spliced_eval": 1, "sweep_report": 1,
            "all": 1}  # fmt: skip
    assert job_counts(out) == want
    assert dump_ranges(out) == ["000000-000001", "000001-000002", "000002-000003", "000003-000004"]
    (p,) = plan_json(cfg)
    assert p["hash"] in out and p["cache"]["state"] == "missing"
    assert not os.path.exists(p["dir"])  # a dry run writes nothing


def test_full_run_verifies_and_then_nothing_to_do(done_project):
    root, cfg = done_project
    (p,) = plan_json(cfg)
    assert p["cache"]["state"] == "complete"
    cache = ActivationCache.open(p["dir"])
    assert cache.n_imgs == N_IMGS and cache.metadata.layers == (-2, -1)
    check = subprocess.run(
        [sys.executable, "-m", "actcache.cli", "verify", "--deep", p["dir"]], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout
    proc = snakemake(cfg, "-n")
    assert proc.returncode == 0 and job_counts(proc.stdout + proc.stderr) == {}
    assert "Nothing to be done" in proc.stdout + proc.stderr
    # each dump job's log shows its progress (images, rate, time) before its shard is written
    logs = glob.glob(os.path.join(root, "logs", "dump", p["hash"], "*.attempt1.*.log"))
    assert len(logs) == 4
    for log in logs:
        with open(log) as fd:
            assert re.search(r"dump: 10/10 img \(100\.0%\), [\d.,]+ img/s", fd.read()), log


def test_deleted_shard_brings_back_exactly_its_job(done_project):
    root, cfg = done_project
    (p,) = plan_json(cfg)
    os.unlink(os.path.join(p["dir"], shard_name(2)))
    proc = snakemake(cfg, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert job_counts(out) == {"dump": 1, "gather": 1, "all": 1}  # the SAEs stay: the data is the same
    assert dump_ranges(out) == ["000002-000003"]
    proc = snakemake(cfg, *TWO_AT_A_TIME)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert plan_json(cfg)[0]["cache"]["state"] == "complete"
    assert job_counts(snakemake(cfg, "-n").stdout) == {}


def tree_digest(*roots: str) -> dict[str, tuple]:
    """Every file and folder under ``roots``: path -> (sha256 of the bytes, size, mtime_ns)."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            out[dirpath] = ("dir", sorted(dirs), sorted(files))
            for f in files:
                path = os.path.join(dirpath, f)
                with open(path, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).hexdigest()
                st = os.stat(path)
                out[path] = (digest, st.st_size, st.st_mtime_ns)
    return out


def test_dry_runs_change_nothing_on_disk_even_with_stale_marks(done_project):
    """A lost shard and an SAE without its done file make their marks stale: the dry run lists
    the jobs that make them again, and the cache and runs directories stay byte-identical."""
    root, cfg = done_project
    (p,) = plan_json(cfg)
    shard = os.path.join(p["dir"], shard_name(1))
    done = os.path.join(p["training"][0]["dir"], "done.json")
    if not os.path.isabs(done):
        done = os.path.join(root, done)
    os.rename(shard, shard + ".aside")
    os.rename(done, done + ".aside")
    try:
        before = tree_digest(os.path.join(root, "cache"), os.path.join(root, "runs"))
        proc = snakemake(cfg, "-n")
        after = tree_digest(os.path.join(root, "cache"), os.path.join(root, "runs"))
    finally:
        os.rename(shard + ".aside", shard)
        os.rename(done + ".aside", done)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert before == after
    assert dump_ranges(out) == ["000001-000002"]
    assert job_counts(out)["train"] == 1
    assert job_counts(snakemake(cfg, "-n").stdout) == {}  # everything back in place: nothing to do


def test_changed_layers_give_a_new_hash(done_project, tmp_path, ckpt):
    root, cfg = done_project
    (before,) = plan_json(cfg)
    cfg2 = write_project(
        str(tmp_path),
        {"wf": experiment(ckpt, vit={"family": "clip", "ckpt": ckpt, "layers": [-1]})},
        dump_to=os.path.join(root, "cache"),
        runs_to=os.path.join(root, "runs"),
    )
    (after,) = plan_json(cfg2)
    assert after["hash"] != before["hash"]
    proc = snakemake(cfg2, "-n")
    out = proc.stdout + proc.stderr
    assert after["hash"] in out and before["hash"] not in out
    assert job_counts(out)["dump"] == 2  # 1 layer: 20 images per shard -> 2 shards


def test_changed_shards_per_job_on_a_complete_cache_is_nothing_to_do(done_project, tmp_path, ckpt):
    """How shards are grouped into jobs is not part of the cache: a finished project stays done."""
    root, cfg = done_project
    doc = experiment(ckpt)
    doc["cache"]["shards_per_job"] = 3
    cfg2 = write_project(
        str(tmp_path), {"wf": doc}, dump_to=os.path.join(root, "cache"), runs_to=os.path.join(root, "runs")
    )
    assert plan_json(cfg2)[0]["hash"] == plan_json(cfg)[0]["hash"]
    dry = snakemake(cfg2, "-n")
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0, out
    assert "Nothing to be done" in out and job_counts(out) == {}, out[-3000:]


def test_changed_sae_hyperparameter_gives_only_training_jobs(done_project, tmp_path, ckpt):
    root, cfg = done_project
    (before,) = plan_json(cfg)
    doc = experiment(ckpt)
    doc["train"]["lr"] = 1e-3  # only the SAEs' learning rate differs
    cfg2 = write_project(
        str(tmp_path), {"wf": doc}, dump_to=os.path.join(root, "cache"), runs_to=os.path.join(root, "runs")
    )
    (after,) = plan_json(cfg2)
    assert after["hash"] == before["hash"] and after["cache"]["state"] == "complete"
    assert {t["sae_id"] for t in after["training"]}.isdisjoint({t["sae_id"] for t in before["training"]})
    proc = snakemake(cfg2, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert job_counts(out) == {"train": 1, "trained": 2, "evaluated": 2, "report": 2, "spliced_eval": 1, "sweep_report": 1, "all": 1}


def _k(k):
    return lambda d: d["train"]["sweep"].update(k=k)


# The edit table of issue 57 (point 5), each made in place in the finished project, as a user would:
# (edit, shard lost, the jobs `snakemake -n` lists, its dump ranges, SAEs plan calls pending, dump jobs plan
# says are to run). A layout, logging or loader key reruns nothing; one SAE's k retrains and re-renders that
# SAE alone (trained: a check of each group member's done file; the other one's page stays).
EDITS = [
    ("log_every", lambda d: d["train"].update(log_every=5), None, {}, [], 0, 0),
    ("n_readers", lambda d: d["train"].update(n_readers=2), None, {}, [], 0, 0),
    ("one SAE's k", _k([4, 16]), None,
     {"train": 1, "trained": 2, "evaluated": 1, "report": 1, "spliced_eval": 1, "sweep_report": 1, "all": 1}, [], 1, 0),
    ("lost shard, shards_per_job 1 -> 2", lambda d: d["cache"].update(shards_per_job=2), 2,
     {"dump": 1, "gather": 1, "all": 1}, ["000002-000004"], 0, 1),
    ("lost shard, shards_per_job 1 -> auto", lambda d: d["cache"].pop("shards_per_job"), 2,
     {"dump": 1, "gather": 1, "all": 1}, ["000000-000004"], 0, 1),  # a tiny cache: one job for all 4 shards
]  # fmt: skip


@pytest.mark.parametrize("what,edit,lost,jobs,ranges,pending,to_dump", EDITS, ids=[e[0] for e in EDITS])
def test_each_edit_reruns_exactly_what_changed_and_plan_agrees(done_project, what, edit, lost, jobs, ranges,
                                                               pending, to_dump):  # fmt: skip
    from actcache.plan import plan_from_config, plan_summary

    root, cfg = done_project
    exp = os.path.join(root, "experiments", "wf.yaml")
    with open(exp) as fd:
        original = fd.read()
    doc = yaml.safe_load(original)
    edit(doc)
    (p,) = [plan_summary(q) for q in plan_from_config(cfg)]  # in-process: no second start-up
    shard = os.path.join(p["dir"], shard_name(lost)) if lost is not None else None
    try:
        with open(exp, "w") as fd:
            yaml.safe_dump(doc, fd, sort_keys=False)
        if shard:
            os.rename(shard, shard + ".aside")
        proc = snakemake(cfg, "-n")
        (row,) = [plan_summary(q) for q in plan_from_config(cfg)]
    finally:
        with open(exp, "w") as fd:
            fd.write(original)
        if shard:
            os.rename(shard + ".aside", shard)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert (job_counts(out), dump_ranges(out)) == (jobs, ranges), out[-3000:]
    assert sum(not t["done"] for t in row["training"]) == pending == jobs.get("report", 0)
    assert row["dump_jobs_to_run"] == to_dump == jobs.get("dump", 0)
    assert row["hash"] == p["hash"]


def test_end_to_end_trained_saes_visuals_and_report(done_project, report_html):
    """profiles/local: demo-sized experiment -> verified cache -> trained SAEs -> visuals -> report.html."""
    root, cfg = done_project
    (p,) = plan_json(cfg)
    assert len(p["training"]) == 2 and all(t["done"] for t in p["training"])
    for t in p["training"]:
        run = os.path.join(root, t["dir"]) if not os.path.isabs(t["dir"]) else t["dir"]
        with open(os.path.join(run, "eval.json")) as fd:
            ev = json.load(fd)
        assert 0 <= ev["nmse"] < 1.0 and ev["l0"] > 0  # better than predicting the mean
        assert os.path.isfile(os.path.join(run, "sae.safetensors"))
        assert os.path.isfile(os.path.join(run, "visuals", "index.html"))
        with open(os.path.join(run, "visuals.html")) as fd:
            page = fd.read()
        assert page.count('class="latent-card"') > 0 and 'src="img/' not in page  # one self-contained file
        assert 'href="visuals/explorer/index.html"' in page  # the explorer of every latent, in the folder
        assert os.path.isfile(os.path.join(run, "visuals", "explorer", "data", "meta.js"))
    with open(report_html) as fd:
        text = fd.read()
    assert "SAE latents" in text and "SAE sweeps" in text  # the report's categories
    assert all(t["sae_id"] in text for t in p["training"])


def test_after_actcache_eval_a_dry_run_lists_the_page_to_render_again(done_project):
    """`actcache eval` rewrites eval.json, which the page shows: that page's rule (only it: the
    other SAE's eval.json is unchanged) is stale to Snakemake."""
    from actcache.cli import main as actcache_main
    from actcache.rundir import spliced_mark_of

    root, cfg = done_project
    (p,) = plan_json(cfg)
    run = p["training"][0]["dir"]
    run = run if os.path.isabs(run) else os.path.join(root, run)
    kept = {f: (os.stat(f).st_mtime_ns, open(f, "rb").read()) for f in (spliced_mark_of(run), os.path.join(run, "eval.json"))}
    try:
        assert actcache_main(["eval", run, "--device", "cpu", "--max-images", "4"]) == 0
        dry = snakemake(cfg, "-n")
        out = dry.stdout + dry.stderr
        assert dry.returncode == 0, out
        assert job_counts(out).get("report") == 1 and f"{os.path.basename(run)}/visuals.html" in out, out[-3000:]
        assert "spliced_eval" not in job_counts(out) and "train" not in job_counts(out)
    finally:
        for f, (before, content) in kept.items():  # the other tests expect a finished project
            with open(f, "wb") as fd:
                fd.write(content)
            os.utime(f, ns=(before, before))
    assert job_counts(snakemake(cfg, "-n").stdout) == {}


# In the page of report.html: each HTML result in an iframe on its data: URL, as the report's viewer
# shows it (named by its result path), and each image result's width once loaded (0: it failed).
SHOW_RESULTS_JS = """(async () => {
  const all = Object.entries(results);
  await Promise.all(all.filter(([, r]) => r.mime_type === 'text/html').map(([path, r]) => new Promise(done => {
    const f = document.createElement('iframe');
    f.name = path; f.style.width = '1300px'; f.style.height = '900px'; f.onload = done; f.src = r.data_uri;
    document.body.appendChild(f);
  })));
  const widths = await Promise.all(all.filter(([, r]) => r.mime_type.startsWith('image/')).map(([, r]) =>
    new Promise(done => { const i = new Image(); i.onload = () => done(i.naturalWidth); i.onerror = () => done(0);
                          i.src = r.data_uri; })));
  return {sizes: all.map(([, r]) => r.data_uri.length), labels: all.map(([, r]) => r.labels), widths: widths};
})()"""
IMAGES_JS = "[document.images.length, Array.from(document.images).filter(i => i.naturalWidth > 0).length]"


def test_report_latent_pages_and_sweep_plots_load_in_chromium(done_project, report_html, chromium):
    """report.html in headless Chromium: each SAE's latent page (a data: URL, under Chromium's 2 MiB
    URL limit) shows its cards and every one of its images; the sweep page's plots load."""
    root, _ = done_project
    saes = {
        os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(root, "runs", "*", "*", "visuals.html"))
    }
    assert len(saes) == 2
    with DevTools(chromium) as browser:
        browser.open(report_html)
        got = browser.eval(SHOW_RESULTS_JS)
        pages = [f for f in browser.frames() if f["name"].endswith("visuals.html")]
        assert {os.path.basename(os.path.dirname(f["name"])) for f in pages} == saes
        for f in pages:
            assert f["url"].startswith("data:text/html"), f  # not left blank (about:blank)
            n_img, n_loaded = browser.eval_in(f["id"], IMAGES_JS)
            assert n_img > 0 and n_loaded == n_img, (f["name"], n_img, n_loaded)
            assert browser.eval_in(f["id"], "document.querySelectorAll('.latent-card').length") > 0
    assert max(got["sizes"]) < 2 * 1024 * 1024
    plots = {lab.get("plot") for lab in got["labels"]} - {None}
    pareto = {"Pareto: L0 against FVU", "Pareto: L0 against spliced fraction recovered",
              "Pareto: L0 against label-probe accuracy"}  # fmt: skip
    assert plots == {"NMSE against L0", "training curves"} | pareto
    assert len(got["widths"]) == 5 and min(got["widths"]) > 0


def test_identical_cache_settings_share_one_hash(tmp_path, ckpt):
    a = experiment(ckpt, name="a")
    b = experiment(ckpt, name="b", cache={**a["cache"], "batch_size": 4, "shards_per_job": 1})
    cfg = write_project(str(tmp_path), {"a": a, "b": b})
    pa, pb = plan_json(cfg)
    assert pa["hash"] == pb["hash"]
    assert job_counts(snakemake(cfg, "-n").stdout)["dump"] == 4


def test_lint_is_clean(tmp_path, ckpt):
    # a project of its own: the default config points at the demo's assets, absent in a fresh clone
    cfg = write_project(str(tmp_path), {"wf": experiment(ckpt)})
    proc = snakemake(cfg, "--lint", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


BAD = [
    ("unknown key", lambda d: d["cache"].update(max_patches=5), "cache.max_patches"),
    ("wrong type", lambda d: d["vit"].update(layers="last"), "vit.layers"),
    ("missing required key", lambda d: d["vit"].pop("family"), "vit.family"),
    ("empty layer list", lambda d: d["vit"].update(layers=[]), "vit.layers"),
    ("layer beyond depth", lambda d: d["vit"].update(layers=[7]), "vit.layers"),
]


@pytest.mark.parametrize("what,mutate,key", BAD, ids=[b[0] for b in BAD])
def test_bad_config_fails_before_any_job(tmp_path, ckpt, what, mutate, key):
    doc = copy.deepcopy(experiment(ckpt))
    mutate(doc)
    cfg = write_project(str(tmp_path), {"bad": doc})
    proc = snakemake(cfg, "--cores", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "bad.yaml" in out and key in out, out[-2000:]
    assert "Traceback" not in out
    assert not os.path.exists(tmp_path / "cache") or not any(
        f.endswith(".bin") for _, _, fs in os.walk(tmp_path / "cache") for f in fs
    )


def test_two_experiments_with_one_name(tmp_path, ckpt):
    cfg = write_project(str(tmp_path), {"one": experiment(ckpt, name="same"), "two": experiment(ckpt, name="same")})
    proc = snakemake(cfg, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "two.yaml" in out and "'name'" in out and "same" in out


def test_bad_workflow_config(tmp_path, ckpt):
    cfg = write_project(str(tmp_path), {"wf": experiment(ckpt)})
    with open(cfg, "a") as fd:
        fd.write("dump_too: oops\n")
    proc = snakemake(cfg, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "dump_too" in out


def test_config_readme_documents_every_train_key():
    from actcache.sae.config import FIELDS, SECTION_ONLY

    with open(os.path.join(REPO, "config", "README.md")) as fd:
        text = fd.read()
    missing = [k for k in (*FIELDS, *SECTION_ONLY) if f"| `{k}` |" not in text]
    assert not missing, f"config/README.md does not document train keys {missing}"
