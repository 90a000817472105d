"""`actcache eval RUN_DIR [RUN_DIR | SWEEP_DIR ...]`: spliced-in downstream metrics into eval.json."""

from __future__ import annotations

from actcache.errors import ConfigError


def cmd_eval(args) -> int:
    from actcache.spliced import spliced_eval

    for name in ("batch_images", "max_images"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    done = spliced_eval(args.run_dirs, device=args.device, batch_images=args.batch_images, max_images=args.max_images,
                        no_images=args.no_images, missing=args.missing)  # fmt: skip
    touch_spliced_marks(list(done))
    return 0


def touch_spliced_marks(run_dirs: list[str]) -> None:
    """Rewrite the workflow's spliced mark (where it exists; never made here) of each evaluated
    run's cache with what was evaluated when: the pages and sweep plots that depend on it are then
    stale to Snakemake (which compares a small input's content, not only its time), so a dry run
    lists them for re-rendering with the new eval.json."""
    import datetime
    import os

    from actcache.fsutil import atomic_write_bytes
    from actcache.rundir import spliced_mark_of

    now = datetime.datetime.now(datetime.UTC).isoformat()
    marks: dict[str, list[str]] = {}
    for d in run_dirs:
        marks.setdefault(spliced_mark_of(d), []).append(os.path.abspath(d))
    for mark, dirs in sorted(marks.items()):
        if os.path.isfile(mark):
            atomic_write_bytes(mark, f"`actcache eval` at {now}: {' '.join(sorted(dirs))}\n".encode())
