"""`actcache export RUN_DIR [RUN_DIR | SWEEP_DIR ...] --to saelens OUT [--push REPO_ID]`; `actcache import FILE_OR_DIR`."""

from __future__ import annotations

from actcache.errors import ConfigError

EXPORT_FORMATS = ("saelens",)


def cmd_export(args) -> int:
    from actcache.export import export_many, push_many
    from actcache.rundir import find_runs

    fmt, out = args.to
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--to {fmt!r}: unknown export format; use one of {', '.join(EXPORT_FORMATS)}")
    if args.n_blocks is not None and args.n_blocks < 1:
        raise ConfigError(f"--n-blocks {args.n_blocks}: the model's number of blocks is at least 1")
    folders = export_many(find_runs(args.run_dirs), out, n_blocks=args.n_blocks, dataset_id=args.dataset)  # a run, or a folder of runs
    for folder in folders:
        print(folder)
    if args.push:
        for url in push_many(folders, args.push):  # one repo, one folder per SAE
            print(url)
    return 0


def cmd_import(args) -> int:
    from actcache.importing import import_sae

    print(import_sae(args.source, args.cache, args.runs_to, layer=args.layer, patches=args.patches,
                     eval_frac=args.eval_frac, device=args.device))  # fmt: skip
    return 0
