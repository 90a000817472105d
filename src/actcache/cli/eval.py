"""`actcache eval RUN_DIR [RUN_DIR | SWEEP_DIR ...]`: spliced-in downstream metrics into eval.json."""

from __future__ import annotations

from actcache.errors import ConfigError


def cmd_eval(args) -> int:
    from actcache.spliced import spliced_eval

    for name in ("batch_images", "max_images"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    spliced_eval(args.run_dirs, device=args.device, batch_images=args.batch_images, max_images=args.max_images,
                 missing=args.missing)
    return 0
