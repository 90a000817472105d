"""`actcache visuals RUN_DIR [RUN_DIR | SWEEP_DIR ...]`: latent pages and plots of trained SAEs."""

from __future__ import annotations

from actcache.errors import ConfigError
from actcache.visuals import VisualsOptions, make_visuals


def _latent_ids(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--latent-ids must be comma-separated integers, got {text!r}") from None


def options(args) -> VisualsOptions:
    for name in ("top_k", "latents", "batch_images"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    return VisualsOptions(
        top_k=args.top_k, latents=args.latents, select=args.select, latent_ids=_latent_ids(args.latent_ids),
        cache=args.cache, device=args.device, batch_images=args.batch_images, no_images=args.no_images,
        reuse=args.reuse, plots_only=args.plots_only, out=args.out, explorer=not args.no_explorer,
    )  # fmt: skip


def cmd_visuals(args) -> int:
    make_visuals(args.run_dirs, options(args), report=print)
    return 0
