"""`actcache import FILE_OR_DIR --cache DIR --runs-to ROOT`: an SAE trained elsewhere as a run directory.

    run_dir = import_sae("sae.pt", cache_dir, runs_to)        # saev's checkpoint (JSON header line + torch.save)
    run_dir = import_sae("saelens_folder/", cache_dir, runs_to)  # cfg.json + sae_weights.safetensors

The run directory is ``<runs_to>/<HASH>/<sae-id>`` like a trained one, so `eval`, `visuals`, the
report and the Pareto views rank it beside the SAEs trained on that cache, on the same held-out
split (the rule of actcache.sae.split with ``eval_frac``). run.json carries an ``imported`` block
(the source, its format and sha256) and the label says "imported"; the weights, config.json and
run.json are made read-only, and done.json is written so training never touches the directory.

Weights map onto actcache's SAE (``pre = (x - b_dec) @ W_enc + b_enc``): an encoder without the
b_dec subtraction (saev's ``x @ W_enc + b_enc``; SAELens with ``apply_b_dec_to_input: false``) gets
``b_enc + b_dec @ W_enc`` instead, the same pre-activations. SAELens architectures: standard ->
relu, topk -> topk, jumprelu -> jumprelu (its thresholds, which must be positive). saev's header
(its first line) names the activation in ``cfg``; ReLU and TopK are read, anything else is a
clear error naming what the header holds. Inputs are taken raw: an SAE that normalises its input
(SAELens ``normalize_activations`` other than "none") is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time

from actcache.errors import ConfigError
from actcache.fsutil import atomic_write_bytes, sha256_file
from actcache.rundir import CONFIG_FILE, DONE_FILE, RUN_FILE, WEIGHTS_FILE, run_dir, weights_records

SAELENS_ARCH = {"standard": "relu", "topk": "topk", "jumprelu": "jumprelu"}
HOOK_RE = re.compile(r"^blocks\.(-?\d+)\.hook_resid_post$")


# ---- reading the foreign formats: (tensors W_enc, b_enc, W_dec, b_dec[, threshold], facts) -------


def read_saelens(folder: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    cfg_path = os.path.join(folder, "cfg.json")
    w_path = os.path.join(folder, "sae_weights.safetensors")
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise ConfigError(f"{folder}: not a SAELens folder (no {os.path.basename(p)})")
    try:
        with open(cfg_path, encoding="utf-8") as fd:
            cfg = json.load(fd)
    except ValueError as err:
        raise ConfigError(f"{cfg_path}: not valid JSON ({err})") from None
    arch = cfg.get("architecture", "standard")
    if arch not in SAELENS_ARCH:
        raise ConfigError(f"{cfg_path}: architecture {arch!r} cannot be imported; known: {', '.join(SAELENS_ARCH)}")
    if cfg.get("normalize_activations", "none") not in ("none", None):
        raise ConfigError(
            f"{cfg_path}: normalize_activations={cfg['normalize_activations']!r}; only SAEs on raw activations "
            "('none') can be imported"
        )
    w = load_file(w_path)
    if not cfg.get("apply_b_dec_to_input", True):
        w["b_enc"] = w["b_enc"] + w["b_dec"] @ w["W_enc"]
    meta = cfg.get("metadata") or {}
    m = HOOK_RE.match(str(meta.get("hook_name") or cfg.get("hook_name") or ""))
    facts = {
        "format": "saelens", "activation": SAELENS_ARCH[arch], "k": cfg.get("k") if arch == "topk" else None,
        "layer": int(m.group(1)) if m else None, "patches": meta.get("token_set"),
        "model": meta.get("model_name"),
    }  # fmt: skip
    return w, facts


def _saev_activation(cfg: dict, where: str) -> tuple[str, int | None]:
    """(activation, k) from saev's header ``cfg``: a string, or a small dict naming it."""
    act = cfg.get("activation", "relu")
    if isinstance(act, dict):
        name = str(act.get("key") or act.get("kind") or act.get("name") or act.get("__class__") or "").lower()
        k = act.get("top_k", act.get("k"))
        if not name and k is not None:
            name = "topk"
    else:
        name, k = str(act).lower(), cfg.get("top_k", cfg.get("k"))
    name = name.replace("-", "").replace("_", "")
    if name == "relu":
        return "relu", None
    if name in ("topk", "batchtopk") and isinstance(k, int):
        return "topk", k
    raise ConfigError(f"{where}: saev activation {act!r} cannot be imported; ReLU and TopK (with its k) can")


def read_saev(path: str) -> tuple[dict, dict]:
    import torch

    with open(path, "rb") as fd:
        header_line = fd.readline()
        body = fd.read()
    try:
        header = json.loads(header_line)
    except ValueError:
        raise ConfigError(f"{path}: not a saev sae.pt (its first line is not a JSON header)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a saev sae.pt (the header is not a JSON object)")
    cfg = header.get("cfg", header)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: the header's cfg is {type(cfg).__name__}, expected an object")
    try:
        state = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling refusal or damage is one line
        raise ConfigError(f"{path}: the state dict after the header cannot be read safely ({err})") from None
    need = {"W_enc", "b_enc", "W_dec", "b_dec"}
    if not isinstance(state, dict) or not need <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"{path}: the state dict has {got}; expected {sorted(need)}")
    w = {k: state[k].float() for k in need}
    w["b_enc"] = w["b_enc"] + w["b_dec"] @ w["W_enc"]  # saev's encoder has no b_dec subtraction
    activation, k = _saev_activation(cfg, path)
    facts = {"format": "saev", "activation": activation, "k": k, "layer": None, "patches": None,
             "model": None, "schema": header.get("schema")}  # fmt: skip
    return w, facts


# ---- the run directory ---------------------------------------------------------------------------


def _build_sae(w: dict, facts: dict, where: str):
    import torch

    from actcache.sae.modeling import SAE
    from actcache.sae.spec import SAEConfig

    D, S = tuple(w["W_enc"].shape)
    want = {"W_enc": (D, S), "b_enc": (S,), "W_dec": (S, D), "b_dec": (D,)}
    for name, shape in want.items():
        if tuple(w[name].shape) != shape:
            raise ConfigError(f"{where}: {name} has shape {tuple(w[name].shape)}, expected {shape}")
    act = facts["activation"]
    param = {"jumprelu_param": "log"} if act == "jumprelu" else {}  # positive thresholds stored as their log
    sae = SAE(SAEConfig(d_vit=D, width=S, activation=act, k=facts["k"], **param))
    state = {k: w[k].to(torch.float32).contiguous() for k in want}
    state["threshold"] = sae.threshold
    if act == "jumprelu":
        th = w.get("threshold")
        if th is None or tuple(th.shape) != (S,) or not bool((th > 0).all()):
            raise ConfigError(f"{where}: a jumprelu SAE needs a positive threshold per latent to be imported")
        state["log_threshold"] = th.double().log().to(torch.float32)
    sae.load_state_dict(state)
    return sae.eval()


def _resolve_layer(layer, facts: dict, md, where: str) -> int:
    """The recorded cache layer the SAE reads: --layer, or the SAE's own hook name."""
    if layer is None:
        layer = facts["layer"]
    if layer is None:
        if len(md.layers) == 1:
            return md.layers[0]
        raise ConfigError(f"{where}: the SAE does not name its layer; pass --layer (the cache has {list(md.layers)})")
    if layer in md.layers:
        return layer
    from actcache.export import model_depth

    depth, _ = model_depth(md)
    if depth is not None:
        for recorded in md.layers:
            if recorded % depth == layer % depth:
                return recorded
    raise ConfigError(
        f"{where}: the SAE reads layer {layer}, which the cache does not record (layers {list(md.layers)}); "
        "import it onto a cache of that layer, or pass --layer if the SAE's layer is named differently"
    )


def import_sae(source: str | os.PathLike, cache_dir: str | os.PathLike, runs_to: str | os.PathLike,
               layer: int | None = None, patches: str | None = None, eval_frac: float | None = None,
               device: str = "cpu") -> str:  # fmt: skip
    """Write ``<runs_to>/<HASH>/<sae-id>`` for the SAE at ``source`` on the cache ``cache_dir``; returns it."""
    from actcache.cache import ActivationCache
    from actcache.labels import read_labels
    from actcache.rundir import load_run
    from actcache.sae.config import RunConfig
    from actcache.sae.evaluate import write_eval
    from actcache.sae.split import RULE, SPLIT_SEED, heldout_images
    from actcache.spliced import heldout_metrics

    source = os.fspath(source)
    if os.path.isdir(source):
        w, facts = read_saelens(source)
        digest_of = os.path.join(source, "sae_weights.safetensors")
    elif os.path.isfile(source):
        w, facts = read_saev(source)
        digest_of = source
    else:
        raise ConfigError(f"{source}: no such file or folder; give a saev sae.pt or a SAELens folder")
    cache = ActivationCache.open(cache_dir)
    md = cache.metadata
    sae = _build_sae(w, facts, source)
    if sae.cfg.d_vit != md.d_vit:
        raise ConfigError(
            f"{source}: the SAE reads d = {sae.cfg.d_vit} but the cache {cache.path} has d_vit = {md.d_vit}"
        )
    layer = _resolve_layer(layer, facts, md, source)
    patches = patches or facts["patches"] or "image"
    if patches not in ("cls", "image", "all"):
        raise ConfigError(f"{source}: token set {patches!r}; use --patches cls, image or all")
    if patches != "image" and not md.cls_token:
        raise ConfigError(f"{source}: token set {patches!r} needs a CLS token, which the cache {cache.path} has not")
    frac = eval_frac if eval_frac is not None else RunConfig.__dataclass_fields__["eval_frac"].default
    if not (isinstance(frac, (int, float)) and 0 <= frac < 1):
        raise ConfigError(f"--eval-frac {frac!r} must be in [0, 1)")
    sha = sha256_file(digest_of)[0]
    sae_id = hashlib.sha256(f"{sha} {md.hash} {layer} {patches}".encode()).hexdigest()[:12]
    out = run_dir(runs_to, md.hash, sae_id)
    if os.path.exists(os.path.join(out, DONE_FILE)):
        return out
    lab = read_labels(cache.path, cache.n_imgs)
    held = heldout_images(cache.n_imgs, frac, None if lab is None else lab[0])
    cfg = sae.cfg
    run_doc = {
        "sae_id": sae_id, "group_id": None, "cache": os.path.abspath(cache.path), "cache_hash": md.hash,
        "layer": layer, "d_vit": md.d_vit, "width": cfg.width, "train_images": None,
        "split": {"rule": RULE, "seed": SPLIT_SEED, "eval_frac": frac, "n_heldout": int(len(held)),
                  "heldout_images": [int(i) for i in held]},
        "imported": {"from": os.path.abspath(source), "format": facts["format"], "sha256": sha,
                     "model": facts["model"], "schema": facts.get("schema")},
        "run": {"activation": cfg.activation, "width": cfg.width, "k": cfg.k, "layer": layer, "patches": patches,
                "scale_norm": False, "eval_frac": frac, "dense_frac": 0.1,
                "eval_tokens": RunConfig.__dataclass_fields__["eval_tokens"].default},
    }  # fmt: skip
    os.makedirs(out, exist_ok=True)
    sae.save(out)
    atomic_write_bytes(os.path.join(out, RUN_FILE), (json.dumps(run_doc, indent=2) + "\n").encode())
    ev = heldout_metrics(cache, load_run(out), device)
    write_eval(out, ev)
    done = {"sae_id": sae_id, "imported": True, "cache_hash": md.hash,
            "eval": {k: ev.get(k) for k in ("n_tokens", "nmse", "l0", "n_dead", "n_dense")},
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": weights_records(out)}  # fmt: skip
    for name in (WEIGHTS_FILE, CONFIG_FILE, RUN_FILE):  # read-only: an imported SAE is never retrained
        os.chmod(os.path.join(out, name), 0o444)
    atomic_write_bytes(os.path.join(out, DONE_FILE), (json.dumps(done, indent=2) + "\n").encode())
    return out
