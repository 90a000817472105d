"""Validation of a cache directory against protocol v1.

:func:`check_dir` collects every problem (it never raises for a bad cache) so that
``actcache inspect`` can show them all; :func:`validate_dir` raises one error listing them.

Compatibility with caches written by the seed's own writer (the protocol's reference code):
it pads the last shard with zeros to the full shard size, and when n_imgs is an exact multiple
of n_imgs_per_shard it adds a trailing all-zero shard listed with n_imgs 0. Both are accepted
(the second with a warning). Any other deviation is an error.

A saev 2.x cache (:mod:`actcache.saev`) is checked the same way, with its own names: an 8-hex
directory hash, ``n_examples`` in shards.json and an optional labels.bin of known size.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import warnings

from actcache.deepscan import deep_scan
from actcache.errors import CacheIncompleteError, ProtocolError, os_error_text
from actcache.formats import load_metadata
from actcache.protocol import (
    METADATA_FILE,
    SHARDS_FILE,
    Metadata,
    ProtocolWarning,
    ShardInfo,
    read_shards,
    shard_name,
)
from actcache.saev import HASH_LEN, LABELS_FILE
from actcache.saev import read_shards as read_saev_shards

HEX64 = re.compile(r"^[0-9a-f]{64}$")
HEX8 = re.compile(rf"^[0-9a-f]{{{HASH_LEN}}}$")


@dataclasses.dataclass
class ShardStatus:
    name: str
    n_imgs: int
    size: int | None  # bytes on disk, None when missing
    expected: tuple[int, ...]  # sizes accepted for this shard
    padded: bool = False
    n_nonfinite: int | None = None  # filled by a deep check


@dataclasses.dataclass
class Report:
    path: str
    metadata: Metadata | None = None
    shards: list[ShardStatus] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    incomplete: bool = False  # shards.json missing: the dump has not been gathered
    error_cls: type = ProtocolError  # raised by raise_for_problems (VersionError for a version)
    deep: bool = False
    n_nonfinite: int | None = None
    bytes_read: int = 0
    checksums: str | None = None  # deep check: "checksums of all N shard(s) match", "no checksums ...", ...
    digests: dict = dataclasses.field(default_factory=dict)  # shard name -> checksums.Record the deep scan computed

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        if self.problems:
            cls = CacheIncompleteError if self.incomplete else self.error_cls
            lines = "\n  - ".join(self.problems)
            kind = "saev 2.1" if getattr(self.metadata, "foreign", False) else "protocol-v1"
            raise cls(f"{self.path} is not a valid {kind} cache:\n  - {lines}")


def check_dir(
    path: str | os.PathLike, deep: bool = False, check_hash: bool = True, checksums_dir: str | None = None
) -> Report:
    """Every problem of the cache at ``path``; ``deep`` reads every byte (NaN/Inf, checksums).

    ``checksums_dir``: where the shards' checksum records are (default ``<path>/.checksums``; a
    saev cache has its records wherever ``actcache seal --to`` put them).
    """
    path = os.fspath(path)
    rep = Report(path=path, deep=deep)
    if not os.path.exists(path):
        rep.problems.append(f"{path}: directory not found. Check the path (it is <dump_to>/<HASH>).")
        return rep
    if not os.path.isdir(path):
        rep.problems.append(f"{path}: not a directory. A cache is a directory <dump_to>/<HASH>.")
        return rep

    md_path = os.path.join(path, METADATA_FILE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            md = load_metadata(md_path)
        except ProtocolError as err:
            rep.problems.append(str(err))
            rep.error_cls = type(err)
            return rep
    rep.warnings += [str(w.message) for w in caught if issubclass(w.category, ProtocolWarning)]
    rep.metadata = md

    if check_hash:
        _check_hash(path, md, rep)

    sh_path = os.path.join(path, SHARDS_FILE)
    if not os.path.exists(sh_path):
        rep.incomplete = True
        present = sorted(n for n in os.listdir(path) if re.fullmatch(r"acts\d{6}\.bin", n))
        rep.problems.append(
            f"{sh_path}: missing, so the dump is unfinished or was never gathered "
            f"({len(present)} of {md.n_shards} shard files present). Finish the dump, then run "
            f"`actcache gather {path}`."
        )
        rep.problems = [saev_repair(p) if md.foreign else p for p in rep.problems]
        return rep
    try:
        shards = read_saev_shards(path) if md.foreign else read_shards(path)
    except ProtocolError as err:
        rep.problems.append(str(err))
        return rep
    _check_table(path, md, shards, rep)
    if md.foreign:
        _check_saev_labels(path, md, rep)
    else:
        _check_labels(path, md, rep)
    _check_files(path, rep)
    if deep and rep.ok:
        deep_scan(path, md, rep, checksums_dir)
    if md.foreign:
        rep.problems = [saev_repair(p) for p in rep.problems]
    return rep


# Repair advice that only an actcache dump can follow (its shards are written by a dump job).
_OR_REDUMP = re.compile(r",?\s+or\s+re-?dump[^.;]*", re.IGNORECASE)
_DUMP_ADVICE = re.compile(
    r"(?:[.;]\s+|\s+\()(?:(?![.;]\s).)*?"
    r"(?:re-?dump|re-run the dump|rerun its dump|dump job|finish the dump|actcache gather).*$",
    re.IGNORECASE | re.DOTALL,
)
SAEV_REPAIR = (
    "; this is a saev cache, which actcache never writes into: re-create it with saev, or restore the file from a copy."
)


def saev_repair(problem: str) -> str:
    """``problem`` with advice to re-dump or gather (impossible for a saev cache) replaced."""
    problem = _OR_REDUMP.sub("", problem)
    cut = _DUMP_ADVICE.search(problem)
    return problem if cut is None else problem[: cut.start()].rstrip(" .;") + SAEV_REPAIR


def validate_dir(path: str | os.PathLike, deep: bool = False, check_hash: bool = True) -> Report:
    """check_dir, then raise one ProtocolError/CacheIncompleteError listing every problem.

    Tolerated deviations are re-emitted as ProtocolWarning.
    """
    rep = check_dir(path, deep=deep, check_hash=check_hash)
    rep.raise_for_problems()
    for msg in rep.warnings:
        warnings.warn(msg, ProtocolWarning, stacklevel=2)
    return rep


def _check_hash(path: str, md: Metadata, rep: Report) -> None:
    pattern = HEX8 if md.foreign else HEX64
    name = os.path.basename(os.path.normpath(path))
    if not pattern.match(name):
        real = os.path.basename(os.path.realpath(path))
        if pattern.match(real):
            name = real
    digest = md.hash
    if pattern.match(name):
        if name != digest:
            rep.problems.append(
                f"{path}: the directory name is not the hash of its metadata.json (config drift): "
                f"metadata.json hashes to {digest}. metadata.json was edited after the dump, or the "
                "directory was renamed; restore the original metadata.json or re-dump."
            )
    else:
        rep.warnings.append(
            f"{path}: directory name {name!r} is not a content hash; caches normally live at <dump_to>/{digest}."
        )


def _check_table(path: str, md: Metadata, shards: list[ShardInfo], rep: Report) -> None:
    where = os.path.join(path, SHARDS_FILE)
    S, full = md.n_imgs_per_shard, md.shard_nbytes
    # The seed's writer adds an all-zero trailing shard listed with n_imgs 0 on exact multiples.
    trailing_zero = None
    if len(shards) >= 2 and shards[-1].n_imgs == 0 and sum(s.n_imgs for s in shards) == md.n_imgs:
        trailing_zero = shards[-1]
        shards = shards[:-1]
    if trailing_zero is not None and not md.foreign:  # saev 2.x always writes it: no warning
        rep.warnings.append(
            f"{where}: trailing entry {trailing_zero.name} lists n_imgs 0 (written by the seed's "
            "writer when n_imgs is an exact multiple of the shard size); it is ignored."
        )
    if not shards:
        rep.problems.append(f"{where}: lists no shards; expected {md.n_shards}.")
        return
    total = sum(s.n_imgs for s in shards)
    if total != md.n_imgs and md.foreign:
        rep.problems.append(
            f"{where}: shard n_examples add up to {total}, but metadata.json says n_examples={md.n_imgs}; "
            "the saev writer did not finish. Re-create the cache with saev."
        )
    elif total != md.n_imgs:
        rep.problems.append(
            f"{where}: shard n_imgs add up to {total}, but metadata.json says n_imgs={md.n_imgs}. "
            f"Re-run `actcache gather {path}`, or re-dump if shards are missing."
        )
    for i, s in enumerate(shards):
        if s.name != shard_name(i):
            rep.problems.append(f"{where}: entry {i} is named {s.name!r}; expected {shard_name(i)!r}.")
        last = i == len(shards) - 1
        if not last and s.n_imgs != S:
            rep.problems.append(
                f"{where}: {s.name} lists n_imgs={s.n_imgs}; every shard but the last must hold "
                f"n_imgs_per_shard={S} (max_patches_per_shard // (tokens x layers))."
            )
        if last and not 1 <= s.n_imgs <= S:
            rep.problems.append(f"{where}: last shard {s.name} lists n_imgs={s.n_imgs}; expected 1..{S}.")
        exact = s.n_imgs * md.bytes_per_img
        expected = (exact,) if not last or exact == full else (exact, full)
        rep.shards.append(_stat_shard(path, s, expected, rep))
    if trailing_zero is not None:
        rep.shards.append(_stat_shard(path, trailing_zero, (full, 0), rep))


def _check_labels(path: str, md: Metadata, rep: Report) -> None:
    """labels.json/labels.npy, read the way train and eval read them (actcache.labels.read_labels)."""
    from actcache.labels import read_labels

    try:
        read_labels(path, md.n_imgs)
    except ProtocolError as err:
        rep.problems.append(str(err))


def _check_saev_labels(path: str, md: Metadata, rep: Report) -> None:
    """saev's optional labels.bin: uint8 (n_examples, content tokens); only its size is checked."""
    fpath = os.path.join(path, LABELS_FILE)
    if not os.path.exists(fpath):
        return
    size, want = os.path.getsize(fpath), md.labels_nbytes
    if size != want:
        rep.problems.append(
            f"{fpath}: {size:,} bytes, expected {want:,} (one uint8 per content token of each of "
            f"{md.n_imgs} examples); the saev writer was interrupted. Re-create the cache with saev."
        )


def _stat_shard(path: str, s: ShardInfo, expected: tuple[int, ...], rep: Report) -> ShardStatus:
    fpath = os.path.join(path, s.name)
    try:
        size = os.stat(fpath).st_size
    except FileNotFoundError:
        rep.problems.append(
            f"{fpath}: missing (listed in shards.json with n_imgs={s.n_imgs}). Re-run the dump for "
            "this shard, then `actcache gather`."
        )
        return ShardStatus(s.name, s.n_imgs, None, expected)
    except (OSError, ValueError) as err:  # a name too long, with a NUL byte, a symlink loop, no access
        why = os_error_text(err) if isinstance(err, OSError) else str(err)
        rep.problems.append(
            f"{fpath!r}: cannot be read ({why}). The name in shards.json is wrong or the file is out of reach; "
            f"re-run `actcache gather {path}` after re-dumping the shard."
        )
        return ShardStatus(s.name, s.n_imgs, None, expected)
    st = ShardStatus(s.name, s.n_imgs, size, expected, padded=len(expected) == 2 and size == expected[1] != expected[0])
    if size not in expected:
        want = " or ".join(f"{e:,}" for e in expected)
        kind = "truncated" if size < min(expected) else "too large"
        rep.problems.append(
            f"{fpath}: {size:,} bytes, expected {want} ({s.n_imgs} images x {rep.metadata.bytes_per_img:,} "
            f"bytes each); the file is {kind}. Delete it and re-run the dump for this shard."
        )
    return st


# ---- the shard files themselves: one file each, inside the cache, readable ---------------------


def _check_files(path: str, rep: Report) -> None:
    """Two names for one file (hard link, or a symlink to another shard), a symlink leading out of
    the cache directory, and a shard that cannot be opened and read are problems."""
    real_dir = os.path.realpath(path)
    seen: dict[tuple[int, int], str] = {}
    for st in rep.shards:
        if st.size is None:
            continue
        fpath = os.path.join(path, st.name)
        if os.path.islink(fpath):
            target = os.path.realpath(fpath)
            if os.path.commonpath([real_dir, target]) != real_dir:
                rep.problems.append(
                    f"{fpath}: a symlink leading out of the cache directory (to {target}); a cache is one "
                    "directory. Replace the link by a copy of the file (cp --remove-destination TARGET LINK)."
                )
        try:
            info = os.stat(fpath)
            if not stat.S_ISREG(info.st_mode):
                rep.problems.append(f"{fpath}: not a regular file; delete it and re-run the dump for this shard.")
                continue
            os.close(os.open(fpath, os.O_RDONLY))  # no byte read: the page cache stays as it was
        except OSError as err:
            rep.problems.append(
                f"{fpath}: cannot be read ({err.strerror or err}); fix its permissions, or delete it and "
                "re-run the dump for this shard."
            )
            continue
        key = (info.st_dev, info.st_ino)
        if key in seen:
            rep.problems.append(
                f"{fpath}: the same file as {seen[key]} (a hard link or symlink, not a shard of its own); "
                f"delete {st.name} and re-run the dump for this shard."
            )
        else:
            seen[key] = st.name
