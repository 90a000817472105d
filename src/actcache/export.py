"""Export trained SAEs as SAELens folders with a model card, ready for the Hugging Face Hub.

    export_saelens("runs/<HASH>/<sae-id>", "out/<sae-id>")   # cfg.json, sae_weights.safetensors, README.md
    export_many(["runs/<HASH>/a", ...], "out")               # one folder per SAE, named by its id
    push_many(["out/a", "out/b"], "user/vit-saes")         # one repo, one folder per SAE (a/, b/)

The folder is what ``sae_lens.SAE.load_from_disk(folder)`` reads: tensors W_enc (D, S), W_dec
(S, D), b_enc (S,), b_dec (D,), plus threshold (S,) for JumpReLU. Objectives map onto SAELens's
inference architectures: relu -> "standard", topk -> "topk", jumprelu -> "jumprelu" with its
learned per-latent thresholds, and batchtopk and matryoshka -> "jumprelu" with every latent's
threshold set to the learned inference threshold (SAELens saves its own BatchTopK and Matryoshka
SAEs the same way; the prefixes only matter in training). Its JumpReLU keeps relu(pre) where
pre > threshold, which equals ours because every threshold is positive. An SAE trained with ``scale_norm`` has the scale folded into W_enc, W_dec
and b_dec, so the folder takes raw activations. The hook name follows SAELens's residual-stream
convention: ``blocks.<layer>.hook_resid_post`` is the output of block ``layer``, counted from 0; a
layer configured from the end (-2) is written as its absolute block (10 of 12), which needs the
model's depth (read from its config, or given as ``n_blocks``). cfg.json's metadata carries
``sae_lens_version`` (the SAELens 6 format it follows): without it SAELens treats the file as a
pre-6.0 one and drops the whole metadata block on load.
"""

from __future__ import annotations

import json
import math
import os

from actcache.errors import ActCacheError, ConfigError
from actcache.fsutil import atomic_write_bytes
from actcache.rundir import DONE_FILE, EVAL_FILE, RUN_FILE, load_run

WEIGHTS_FILE = "sae_weights.safetensors"
CFG_FILE = "cfg.json"
CARD_FILE = "README.md"
SAELENS_FORMAT = "6.0.0"  # the SAELens cfg.json format written here (SAELens reads the metadata from 6.0 on)
ARCHITECTURES = {
    "relu": "standard", "topk": "topk", "jumprelu": "jumprelu", "batchtopk": "jumprelu", "matryoshka": "jumprelu",
}  # fmt: skip


def _read_json(path: str, what: str) -> dict:
    """A run file as a JSON object, read within docfiles' bounds; every failure one ConfigError line."""
    from actcache.docfiles import load_json_file

    if not os.path.lexists(path):
        raise ConfigError(f"{path}: missing; {what}")
    doc = load_json_file(path, ConfigError, "run file")
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a JSON object; re-run training for this SAE")
    return doc


def _cache_metadata(cache_dir: str):
    """The source cache's metadata, or None when the cache is no longer there."""
    from actcache.formats import load_metadata

    try:
        return load_metadata(cache_dir)
    except ActCacheError:
        return None


def _scale(run: dict, cache_dir: str) -> float:
    """The factor ``scale_norm`` multiplied activations by in training (1.0 without it)."""
    cfg = run["run"]
    if not cfg.get("scale_norm"):
        return 1.0
    from actcache.cache import ActivationCache
    from actcache.stats import load_or_compute

    mean = load_or_compute(ActivationCache.open(cache_dir))["layers"][str(run["layer"])][cfg["patches"]]
    return math.sqrt(run["d_vit"]) / mean if mean > 0 else 1.0


def saelens_tensors(sae, scale: float = 1.0) -> dict:
    """SAELens's state dict for ``sae`` taking raw activations (x * scale is what it was trained on)."""
    import torch

    act = sae.cfg.activation
    if act not in ARCHITECTURES:
        raise ConfigError(f"export: objective {act!r} has no SAELens architecture yet; known: {list(ARCHITECTURES)}")
    with torch.no_grad():
        out = {
            "W_enc": sae.W_enc * scale,
            "b_enc": sae.b_enc.clone(),
            "W_dec": sae.W_dec / scale,
            "b_dec": sae.b_dec / scale,
        }
        if act == "jumprelu":  # the pre-activations are unchanged by the folded scale, so are thresholds
            out["threshold"] = sae.jumprelu_threshold().to(sae.b_enc.dtype)
        elif act in ("batchtopk", "matryoshka"):
            th = float(sae.threshold)
            if not th > 0:
                raise ConfigError(f"export: the {act} threshold is {th}; train the SAE before exporting it")
            out["threshold"] = torch.full_like(sae.b_enc, th)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def block_index(run: dict, md, n_blocks: int | None = None) -> int:
    """The absolute index of the block whose output the SAE reads (``run["layer"]`` may count from the end)."""
    layer = int(run["layer"])
    if layer >= 0:
        return layer
    if n_blocks is None:
        n_blocks, why = model_depth(md)
        if n_blocks is None:
            raise ConfigError(
                f"export: layer {layer} counts from the end of the model and its depth is unknown ({why}); "
                "pass --n-blocks N, the model's number of transformer blocks"
            )
    if not -n_blocks <= layer < 0:
        raise ConfigError(f"export: layer {layer} does not exist in a model of {n_blocks} blocks; check --n-blocks")
    return layer % n_blocks


def model_depth(md) -> tuple[int | None, str]:
    """(number of blocks, "") from the checkpoint's config, or (None, why not)."""
    if md is None:
        return None, "the source cache is gone"
    if md.foreign:
        return None, f"a saev cache names {md.vit_ckpt!r}, an open_clip/timm model actcache does not read"
    from actcache.models import describe_checkpoint

    try:
        return describe_checkpoint(md.vit_family, md.vit_ckpt).n_layers, ""
    except ActCacheError as err:
        return None, f"cannot read the config of {md.vit_ckpt!r}: {str(err).splitlines()[0]}"


def saelens_cfg(sae, run: dict, md, n_blocks: int | None = None) -> dict:
    """cfg.json: SAELens's config fields, and a metadata block naming the model and the hook."""
    cfg = run["run"]
    block = block_index(run, md, n_blocks)
    doc = {
        "d_in": sae.cfg.d_vit, "d_sae": sae.cfg.width, "dtype": sae.cfg.dtype, "device": "cpu",
        "apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none",
        "architecture": ARCHITECTURES[sae.cfg.activation],
    }  # fmt: skip
    if sae.cfg.activation == "topk":
        doc.update(k=sae.cfg.k, rescale_acts_by_decoder_norm=False)
    doc["metadata"] = {
        "model_name": md.vit_ckpt if md else None,
        "model_class_name": md.vit_family if md else None,
        "hook_name": f"blocks.{block}.hook_resid_post",
        "hook_head_index": None,
        "prepend_bos": False,
        "context_size": md.n_tokens_per_img if md else None,
        "exclude_special_tokens": cfg["patches"] == "image",
        "token_set": cfg["patches"],
        "layer": block,
        "layer_as_configured": run["layer"],
        "cache_hash": run["cache_hash"],
        "actcache_sae_id": run["sae_id"],
        "actcache_objective": sae.cfg.activation,
        "matryoshka_prefixes": list(sae.cfg.matryoshka_prefixes or []) or None,
        "scale_norm_folded": bool(cfg.get("scale_norm")),
        "dataset_path": _dataset_name(md),
        "sae_lens_version": SAELENS_FORMAT,
        "sae_lens_training_version": None,  # trained by actcache, not SAELens
    }
    return doc


def _dataset_name(md) -> str | None:
    """Where the cache's images came from, as its metadata says (a saev cache: its ``dataset`` field)."""
    if md is None:
        return None
    if md.foreign:
        return md.dataset or None
    data = md.data if isinstance(md.data, dict) else {}
    where = data.get("root") or data.get("path")
    if where is None and data.get("__class__") == "SyntheticImages":
        where = f"synthetic images (seed {data.get('seed')})"
    return f"{data.get('__class__', 'dataset')} {where}" if where else data.get("__class__")


def _hub_id(name: str | None) -> str | None:
    """``name`` as a Hub repo id (owner/name), or None for a local path; saev's ``hf-hub:`` prefix dropped."""
    from actcache.models import is_local_checkpoint

    if not name:
        return None
    name = name.removeprefix("hf-hub:")
    return name if name.count("/") == 1 and not is_local_checkpoint(name) and " " not in name else None


# The card's metrics: eval.json's own definitions, with the value a trivial SAE scores (chance level).
CARD_METRICS = {
    "nmse": "1.0 (always predicting the mean activation)",
    "l0": "0 (no latent fires)",
    "n_dead": "the number of latents (no latent fires)",
    "n_almost_dead": "0 (no latent fires: all are dead)",
    "n_dense": "0",
    "n_tokens": "",
}


def _dead_note(ev: dict) -> str:
    """n_dead and n_almost_dead's one definition (eval.json's), under the metrics table."""
    return f"\nn_dead, n_almost_dead: {ev['dead_definition']}.\n" if ev.get("dead_definition") else ""


def _metric_rows(ev: dict) -> str:
    defs = ev.get("definitions") or {}
    defs = {"nmse": defs.get("fvu", ""), "n_tokens": "held-out tokens the metrics are computed over", **defs}
    for k in ("n_dead", "n_almost_dead"):
        defs[k] = defs.get(k) or "see the definition under the table"
    rows = []
    for name, chance in CARD_METRICS.items():
        if name in ev:
            v = ev[name]
            shown = f"{v:.6g}" if isinstance(v, float) else str(v)
            text = defs.get(name, "").replace("||", "\u2016").replace("|", "/")  # a "|" would split the table's cell
            rows.append(f"| {name} | {shown} | {text} | {chance} |")
    return "\n".join(rows)


def model_card(cfg_doc: dict, run: dict, ev: dict, md, dataset_id: str | None = None) -> str:
    """README.md for the Hub: what the SAE reads, how it was trained, how well it reconstructs."""
    meta, obj = cfg_doc["metadata"], run["run"]
    rows = _metric_rows(ev)
    k = f", k = {obj.get('k')}" if obj.get("k") is not None else ""
    model = f"{meta['model_class_name']} `{meta['model_name']}`" if md else "unknown (source cache not found)"
    if md is not None and md.foreign and md.vit_family == "clip":
        model += " (saev's `clip` family: an open_clip model)"
    base = _hub_id(meta["model_name"])
    data_id = _hub_id(dataset_id)
    front = [f"base_model: {base}"] if base else []
    front += [f"datasets:\n- {data_id}"] if data_id else []
    layer = meta["layer_as_configured"]
    rel = f" (configured as layer {layer}, counted from the end)" if layer != meta["layer"] else ""
    n_imgs = f", {md.n_imgs:,} images" if md is not None else ""
    return f"""---
library_name: saelens
{chr(10).join(front) + chr(10) if front else ""}tags:
- sparse-autoencoder
- sae-lens
- vision-transformer
---

# Sparse autoencoder `{run["sae_id"]}`

- **Model:** {model}
- **Layer:** output of block {meta["layer"]}, counted from 0{rel} (`{meta["hook_name"]}`)
- **Token set:** `{meta["token_set"]}` (cls: the CLS token; image: patch tokens; all: both)
- **Objective:** {obj.get("activation")}{k}, {cfg_doc["d_sae"]} latents on d_in = {cfg_doc["d_in"]}
  (SAELens architecture `{cfg_doc["architecture"]}`)
- **Training data:** {meta["dataset_path"] or "unknown (source cache not found)"}{n_imgs}{f" (`{data_id}`)" if data_id else ""}
- **Source cache hash:** `{run["cache_hash"]}`
- **Input scaling:** {"folded into the weights; give raw activations" if meta["scale_norm_folded"] else "none"}

## Held-out metrics

Computed on the held-out split of the training cache (the tokens no training step saw).

| metric | value | definition | trivial SAE scores |
|---|---|---|---|
{rows or "| (no held-out evaluation) | | | |"}
{_dead_note(ev)}
## Load

```python
from sae_lens import SAE
sae = SAE.load_from_disk("path/to/this/folder")
sae.cfg.metadata.hook_name  # "{meta["hook_name"]}"
```

Trained with actcache; the run's settings: `{json.dumps(obj, sort_keys=True)}`.
"""


def export_saelens(run_dir: str | os.PathLike, out_dir: str | os.PathLike, n_blocks: int | None = None,
                   dataset_id: str | None = None) -> str:  # fmt: skip
    """Write ``out_dir``/{cfg.json, sae_weights.safetensors, README.md} for a finished run.

    ``n_blocks``: the model's depth, needed only for a layer counted from the end whose model config
    actcache cannot read; ``dataset_id``: the Hub dataset the images came from, for the card."""
    from safetensors.torch import save as st_save

    from actcache.sae.modeling import SAE

    run_dir, out_dir = os.fspath(run_dir), os.fspath(out_dir)
    _read_json(os.path.join(run_dir, DONE_FILE), "the SAE has not finished training; export it once it has")
    run = _read_json(os.path.join(run_dir, RUN_FILE), "not an actcache run directory")
    load_run(run_dir)  # run.json's fields of the wrong type: one line
    ev = _read_json(os.path.join(run_dir, EVAL_FILE), "the run has no held-out evaluation")
    sae = SAE.load(run_dir)  # checked against done.json's record of the weights
    md = _cache_metadata(run["cache"])
    cfg_doc = saelens_cfg(sae, run, md, n_blocks)
    scale = _scale(run, run["cache"])
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_bytes(os.path.join(out_dir, WEIGHTS_FILE), st_save(saelens_tensors(sae, scale)))
    atomic_write_bytes(os.path.join(out_dir, CFG_FILE), (json.dumps(cfg_doc, indent=2) + "\n").encode())
    atomic_write_bytes(os.path.join(out_dir, CARD_FILE), model_card(cfg_doc, run, ev, md, dataset_id).encode())
    return out_dir


def export_many(run_dirs, out_root: str | os.PathLike, n_blocks: int | None = None,
                dataset_id: str | None = None) -> list[str]:  # fmt: skip
    """One SAELens folder per run, ``<out_root>/<sae-id>``; returns them."""
    out = []
    for run_dir in run_dirs:
        sae_id = _read_json(os.path.join(os.fspath(run_dir), RUN_FILE), "not an actcache run directory")["sae_id"]
        out.append(export_saelens(run_dir, os.path.join(os.fspath(out_root), sae_id), n_blocks, dataset_id))
    return out


def login_command() -> str:
    """The login command of the installed huggingface_hub (`hf auth login` from 1.0; older: huggingface-cli)."""
    try:
        import huggingface_hub

        major = int(huggingface_hub.__version__.split(".")[0])
    except (ImportError, ValueError):
        return "hf auth login"
    return "hf auth login" if major >= 1 else "huggingface-cli login"


def push(folder: str | os.PathLike, repo_id: str, path_in_repo: str | None = None) -> str:
    """Upload one exported SAE folder to the Hub (under ``path_in_repo`` when given); any failure
    (offline, no token, HTTP) is one clear error."""
    return push_many([folder], repo_id, [path_in_repo])[0]


def push_many(folders, repo_id: str, paths_in_repo=None) -> list[str]:
    """Upload exported SAE folders into one Hub repo, each as a folder of its own (default: its
    name, the SAE id); returns each commit's URL."""
    folders = [os.fspath(f) for f in folders]
    paths = list(paths_in_repo) if paths_in_repo is not None else [os.path.basename(f) for f in folders]
    for folder in folders:
        if not os.path.isfile(os.path.join(folder, CFG_FILE)):
            raise ConfigError(
                f"{folder}: no {CFG_FILE}; export the SAE there first (actcache export RUN_DIR --to saelens OUT)"
            )
    out = []
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError("--push needs huggingface_hub: pip install huggingface_hub") from None
    try:
        huggingface_hub.create_repo(repo_id, exist_ok=True)
        for folder, path in zip(folders, paths, strict=True):
            info = huggingface_hub.upload_folder(
                folder_path=folder, repo_id=repo_id, path_in_repo=path,
                commit_message=f"actcache export: SAE {os.path.basename(folder)}",
            )  # fmt: skip
            out.append(str(getattr(info, "commit_url", info)))
    except Exception as err:  # noqa: BLE001 - offline, auth and HTTP errors all end here
        reason = " ".join(str(err).split()) or type(err).__name__
        done = f"; {len(out)} of {len(folders)} uploaded" if out else ""
        raise ActCacheError(
            f"cannot upload to the Hub repo {repo_id!r} ({type(err).__name__}: {reason[:300]}){done}; check the "
            f"network and your token ({login_command()}), then push again: the exported folders are complete."
        ) from None
    return out
