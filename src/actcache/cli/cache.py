"""`actcache hash | inspect | verify | gather | demo-cache`: cache information and small writes."""

from __future__ import annotations

import json
import os

from actcache.formats import describe_data, describe_format


def cmd_hash(args) -> int:
    from actcache.protocol import Metadata

    print(Metadata.load(args.metadata).hash)
    return 0


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _token_labels(rep) -> str | None:
    """A saev cache's per-patch labels file, described (None when there is none)."""
    from actcache.saev import LABELS_FILE

    md = rep.metadata
    if md is None or not md.foreign or not os.path.isfile(os.path.join(rep.path, LABELS_FILE)):
        return None
    return (
        f"{LABELS_FILE}: saev's per-patch labels, uint8 ({md.n_imgs:,} examples x {md.n_patches_per_img} patches; "
        "no CLS slot); loaders yield them with token_labels=True"
    )


def _report_dict(rep) -> dict:
    md = rep.metadata
    return {
        "path": os.path.abspath(rep.path),
        "ok": rep.ok,
        "hash": md.hash if md else None,
        "metadata": md.to_dict() if md else None,
        "format": None if md is None else dict(zip(("what", "readers"), describe_format(md), strict=True)),
        "data": None if md is None else describe_data(md),
        "token_labels": _token_labels(rep),
        "derived": None
        if md is None
        else {
            "n_tokens_per_img": md.n_tokens_per_img,
            "n_imgs_per_shard": md.n_imgs_per_shard,
            "n_shards": md.n_shards,
            "shard_shape": list(md.shard_shape),
            "bytes_per_img": md.bytes_per_img,
            "total_bytes": md.n_imgs * md.bytes_per_img,
        },
        "shards": [
            {"name": s.name, "n_imgs": s.n_imgs, "size": s.size, "padded": s.padded, "n_nonfinite": s.n_nonfinite}
            for s in rep.shards
        ],
        "problems": rep.problems,
        "warnings": rep.warnings,
        "deep": rep.deep,
        "n_nonfinite": rep.n_nonfinite,
        "checksums": rep.checksums,
    }


def _print_report(rep, show_shards: bool) -> None:
    md = rep.metadata
    print(f"cache     {os.path.abspath(rep.path)}")
    if md is not None:
        print(f"hash      {md.hash}")
        print(f"model     {md.vit_family} {md.vit_ckpt}")
        print(f"layers    {list(md.layers)}")
        print(
            f"tokens    {md.n_tokens_per_img} per image ({'CLS + ' if md.cls_token else ''}"
            f"{md.n_patches_per_img} patches), d_vit {md.d_vit}, {md.dtype}"
        )
        print(
            f"images    {md.n_imgs:,} in {md.n_shards} shard(s) of {md.n_imgs_per_shard:,} (max_patches_per_shard {md.max_patches_per_shard:,})"
        )
        print(
            f"size      {_fmt_bytes(md.n_imgs * md.bytes_per_img)} of activations ({_fmt_bytes(md.bytes_per_img)} per image)"
        )
        print(f"data      {describe_data(md)}")
        labels = _token_labels(rep)
        if labels:
            print(f"labels    {labels}")
        print(f"protocol  {md.protocol}")
        what, readers = describe_format(md)
        print(f"format    {what}")
        print(f"readers   {readers}")
    if show_shards and rep.shards:
        print("shards")
        for s in rep.shards:
            size = "missing" if s.size is None else _fmt_bytes(s.size)
            extra = " (zero-padded to full size)" if s.padded else ""
            bad = f", {s.n_nonfinite} NaN/Inf" if s.n_nonfinite else ""
            print(f"  {s.name}  {s.n_imgs:>8,} images  {size:>10}{extra}{bad}")
    for w in rep.warnings:
        print(f"warning: {w}")
    if rep.deep and rep.ok:
        print(f"deep      read {_fmt_bytes(rep.bytes_read)}, {rep.n_nonfinite} NaN/Inf values, {rep.checksums}")
    if rep.ok:
        print("verdict   OK: complete and consistent")
    else:
        print(f"verdict   INVALID ({len(rep.problems)} problem(s)):")
        for prob in rep.problems:
            print(f"  - {prob}")


def cmd_inspect(args) -> int:
    from actcache.validate import check_dir

    rep = check_dir(args.dir)
    if args.json:
        print(json.dumps(_report_dict(rep), indent=2))
    else:
        _print_report(rep, show_shards=True)
    return 0 if rep.ok else 1


def cmd_verify(args) -> int:
    from actcache.validate import check_dir

    rep = check_dir(args.dir, deep=args.deep, checksums_dir=args.checksums)
    if args.json:
        print(json.dumps(_report_dict(rep), indent=2))
    else:
        _print_report(rep, show_shards=False)
    return 0 if rep.ok else 1


def cmd_seal(args) -> int:
    from actcache.checksums import record_dir
    from actcache.seal import seal

    rep, new = seal(args.dir, to=args.to)
    _print_report(rep, show_shards=False)
    if rep.ok:
        print(f"sealed    {len(new)} shard(s) given checksums in {args.to or record_dir(args.dir)}")
    return 0 if rep.ok else 1


def cmd_gather(args) -> int:
    from actcache.writer import gather

    path = gather(args.dir)
    print(f"wrote {path}")
    return 0


def cmd_convert(args) -> int:
    from actcache.errors import ConfigError
    from actcache.formats import load_metadata

    foreign = load_metadata(args.dir).foreign
    if args.to_format == "saev":
        from actcache.saev_convert import to_saev

        if args.dtype not in (None, "float32"):
            raise ConfigError(f"--dtype {args.dtype}: a saev cache stores float32 only; drop --dtype")
        dest, notes = to_saev(args.dir, args.to)
        print(dest)
        for note in notes:
            print(f"note      {note}")
        return 0
    if foreign:
        from actcache.saev_convert import from_saev

        print(from_saev(args.dir, args.dtype or "float32", args.to))
        return 0
    from actcache.convert import convert

    if args.dtype is None:
        raise ConfigError(f"{args.dir}: convert needs --dtype (float32, float16 or bfloat16) or --to-format saev")
    print(convert(args.dir, args.dtype, args.to, allow_rounded=args.allow_rounded))
    return 0


def cmd_demo_cache(args) -> int:
    from actcache.writer import synthetic_fill, synthetic_metadata, write_cache

    md = synthetic_metadata(args.n_imgs, layers=(4, 10), max_patches_per_shard=17 * 2 * 64)
    path = write_cache(args.dump_to, md, synthetic_fill(md))
    print(path)
    return 0
