"""`actcache export RUN_DIR [RUN_DIR | SWEEP_DIR ...] --to saelens OUT [--push REPO_ID]`."""

from __future__ import annotations

from actcache.errors import ConfigError

EXPORT_FORMATS = ("saelens",)


def cmd_export(args) -> int:
    from actcache.export import export_many, push
    from actcache.rundir import find_runs

    fmt, out = args.to
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--to {fmt!r}: unknown export format; use one of {', '.join(EXPORT_FORMATS)}")
    for folder in export_many(find_runs(args.run_dirs), out):  # a run, or a folder of runs
        print(folder)
    if args.push:
        print(push(out, args.push))
    return 0
