"""Export trained SAEs as SAELens folders with a model card, ready for the Hugging Face Hub.

    export_saelens("runs/<HASH>/<sae-id>", "out/<sae-id>")   # cfg.json, sae_weights.safetensors, README.md
    export_many(["runs/<HASH>/a", ...], "out")               # one folder per SAE, named by its id
    push("out/<sae-id>", "user/vit-saes")                    # huggingface_hub.upload_folder

The folder is what ``sae_lens.SAE.load_from_disk(folder)`` reads: tensors W_enc (D, S), W_dec
(S, D), b_enc (S,), b_dec (D,), plus threshold (S,) for JumpReLU. Objectives map onto SAELens's
inference architectures: relu -> "standard", topk -> "topk", jumprelu -> "jumprelu" with its
learned per-latent thresholds, and batchtopk and matryoshka -> "jumprelu" with every latent's
threshold set to the learned inference threshold (SAELens saves its own BatchTopK and Matryoshka
SAEs the same way; the prefixes only matter in training). Its JumpReLU keeps relu(pre) where
pre > threshold, which equals ours because every threshold is positive. An SAE trained with ``scale_norm`` has the scale folded into W_enc, W_dec
and b_dec, so the folder takes raw activations. The hook name follows SAELens's residual-stream
convention: ``blocks.<layer>.hook_resid_post`` is the output of block ``layer``.
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


def saelens_cfg(sae, run: dict, md) -> dict:
    """cfg.json: SAELens's config fields, and a metadata block naming the model and the hook."""
    cfg = run["run"]
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
        "hook_name": f"blocks.{run['layer']}.hook_resid_post",
        "hook_head_index": None,
        "prepend_bos": False,
        "context_size": md.n_tokens_per_img if md else None,
        "exclude_special_tokens": cfg["patches"] == "image",
        "token_set": cfg["patches"],
        "layer": run["layer"],
        "cache_hash": run["cache_hash"],
        "actcache_sae_id": run["sae_id"],
        "actcache_objective": sae.cfg.activation,
        "matryoshka_prefixes": list(sae.cfg.matryoshka_prefixes or []) or None,
        "scale_norm_folded": bool(cfg.get("scale_norm")),
    }
    return doc


def model_card(cfg_doc: dict, run: dict, ev: dict, md) -> str:
    """README.md for the Hub: what the SAE reads, how it was trained, how well it reconstructs."""
    meta, obj = cfg_doc["metadata"], run["run"]
    metrics = {k: ev[k] for k in ("nmse", "l0", "n_dead", "n_dense", "n_tokens") if k in ev}
    rows = "\n".join(f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items())
    k = f", k = {obj.get('k')}" if obj.get("k") is not None else ""
    model = f"{meta['model_class_name']} `{meta['model_name']}`" if md else "unknown (source cache not found)"
    return f"""---
library_name: saelens
tags:
- sparse-autoencoder
- sae-lens
- vision-transformer
---

# Sparse autoencoder `{run["sae_id"]}`

- **Model:** {model}
- **Layer:** output of block {run["layer"]} (`{meta["hook_name"]}`)
- **Token set:** `{meta["token_set"]}` (cls: the CLS token; image: patch tokens; all: both)
- **Objective:** {obj.get("activation")}{k}, {cfg_doc["d_sae"]} latents on d_in = {cfg_doc["d_in"]}
  (SAELens architecture `{cfg_doc["architecture"]}`)
- **Source cache hash:** `{run["cache_hash"]}`
- **Input scaling:** {"folded into the weights; give raw activations" if meta["scale_norm_folded"] else "none"}

## Held-out metrics

| metric | value |
|---|---|
{rows or "| (no held-out evaluation) | |"}

## Load

```python
from sae_lens import SAE
sae = SAE.load_from_disk("path/to/this/folder")
```

Trained with actcache; the run's settings: `{json.dumps(obj, sort_keys=True)}`.
"""


def export_saelens(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Write ``out_dir``/{cfg.json, sae_weights.safetensors, README.md} for a finished run."""
    from safetensors.torch import save as st_save

    from actcache.sae.modeling import SAE

    run_dir, out_dir = os.fspath(run_dir), os.fspath(out_dir)
    _read_json(os.path.join(run_dir, DONE_FILE), "the SAE has not finished training; export it once it has")
    run = _read_json(os.path.join(run_dir, RUN_FILE), "not an actcache run directory")
    load_run(run_dir)  # run.json's fields of the wrong type: one line
    ev = _read_json(os.path.join(run_dir, EVAL_FILE), "the run has no held-out evaluation")
    sae = SAE.load(run_dir)  # checked against done.json's record of the weights
    md = _cache_metadata(run["cache"])
    scale = _scale(run, run["cache"])
    cfg_doc = saelens_cfg(sae, run, md)
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_bytes(os.path.join(out_dir, WEIGHTS_FILE), st_save(saelens_tensors(sae, scale)))
    atomic_write_bytes(os.path.join(out_dir, CFG_FILE), (json.dumps(cfg_doc, indent=2) + "\n").encode())
    atomic_write_bytes(os.path.join(out_dir, CARD_FILE), model_card(cfg_doc, run, ev, md).encode())
    return out_dir


def export_many(run_dirs, out_root: str | os.PathLike) -> list[str]:
    """One SAELens folder per run, ``<out_root>/<sae-id>``; returns them."""
    out = []
    for run_dir in run_dirs:
        sae_id = _read_json(os.path.join(os.fspath(run_dir), RUN_FILE), "not an actcache run directory")["sae_id"]
        out.append(export_saelens(run_dir, os.path.join(os.fspath(out_root), sae_id)))
    return out


def push(folder: str | os.PathLike, repo_id: str, path_in_repo: str | None = None) -> str:
    """Upload an exported folder to the Hub; any failure (offline, no token) is one clear error."""
    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, CFG_FILE)):
        raise ConfigError(f"{folder}: no {CFG_FILE}; export the SAE there first (export_saelens)")
    try:
        import huggingface_hub

        huggingface_hub.create_repo(repo_id, exist_ok=True)
        info = huggingface_hub.upload_folder(folder_path=folder, repo_id=repo_id, path_in_repo=path_in_repo)
    except Exception as err:  # noqa: BLE001 - offline, auth and HTTP errors all end here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ActCacheError(
            f"cannot upload {folder} to the Hub repo {repo_id!r} ({type(err).__name__}: {reason}); check the "
            "network and your token (huggingface-cli login), then push again: the folder is complete."
        ) from None
    return str(getattr(info, "commit_url", info))
