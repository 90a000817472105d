"""Reading the small documents users and filesystems hand us (JSON, YAML) within bounds.

Every failure is the caller's ActCacheError subclass with one line that names the file and the
fix: an OS error (permission, symlink loop, name too long, not a regular file), a file larger
than ``MAX_DOC_BYTES``, bytes that are not UTF-8, a parse error, or a document nested deeper
than ``MAX_DEPTH``, or a YAML file holding more than ``MAX_NODES`` values (its aliases can make a
small file expand into a huge or self-referencing structure). Bracket nesting is measured on the raw text
before parsing (PyYAML takes quadratic time on it); YAML's block nesting stopping the parser at
Python's recursion limit is reported the same way.

A file that is not a regular file (a FIFO, a device) is refused before it is read, so a
planted FIFO cannot make a command hang.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat

from actcache.errors import ActCacheError, os_error_text

MAX_DOC_BYTES = 16 * 2**20  # metadata.json, shards.json and experiment files are kilobytes
MAX_DEPTH = 64  # the deepest real document (a train sweep) nests fewer than 10 levels
MAX_NODES = 100_000  # values of a YAML file after its aliases are expanded (an experiment has ~100)


def os_error_line(path: str, err: OSError, what: str = "file") -> str:
    """One line for an OSError on ``path``: what happened and what to do about it."""
    fixes = {
        errno.EACCES: "give the user running actcache read access",
        errno.EPERM: "give the user running actcache read access",
        errno.ELOOP: "the path is a symlink loop; point the link at a real file",
        errno.ENAMETOOLONG: "use a shorter path",
        errno.ENOENT: "check the path",  # kept first in the line: "<path>: <what> not found"
        errno.ENOTDIR: "a component of the path is not a directory; check the path",
        errno.EISDIR: f"it is a directory; give the path of the {what}",
        errno.EIO: "the filesystem failed to read it; check the disk or restore the file",
    }
    fix = fixes.get(err.errno, "check the path and the filesystem")
    if err.errno == errno.ENOENT:
        return f"{path}: {what} not found; {fix}."
    return f"{path}: cannot read the {what}: {os_error_text(err)}; {fix}."


def read_doc_bytes(path: str, error_cls: type[ActCacheError], what: str = "file") -> bytes:
    """The bytes of a small regular file; any OS error or an oversized file is ``error_cls``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as err:
        if isinstance(err, ValueError):  # an embedded NUL byte in the path
            raise error_cls(f"{path!r}: not a usable path ({err}); check the path.") from None
        raise error_cls(os_error_line(path, err, what)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error_cls(f"{path}: not a regular file; the {what} must be a plain file.")
        if st.st_size > MAX_DOC_BYTES:
            raise error_cls(
                f"{path}: {st.st_size:,} bytes, more than the {MAX_DOC_BYTES // 2**20} MiB allowed for the {what}; "
                "check that it is the right file."
            )
        with os.fdopen(os.dup(fd), "rb") as fh:
            raw = fh.read(MAX_DOC_BYTES + 1)
    except OSError as err:
        raise error_cls(os_error_line(path, err, what)) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_DOC_BYTES:
        raise error_cls(f"{path}: larger than {MAX_DOC_BYTES // 2**20} MiB; check that it is the right {what}.")
    return raw


def decode_utf8(raw: bytes, path: str, error_cls: type[ActCacheError], what: str = "file") -> str:
    """UTF-8 text (a BOM is allowed); other encodings get a line naming the byte and its line."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise error_cls(
            f"{path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at line {line}); save the {what} as UTF-8."
        ) from None


_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def text_depth(text: str) -> int:
    """An upper bound of the bracket nesting of ``text`` (brackets inside strings count too); the
    other characters are dropped at C speed first, so a large flat document costs little."""
    brackets = _NOT_BRACKETS.sub("", text)
    if len(brackets) <= MAX_DEPTH:
        return len(brackets)
    depth = deepest = 0
    for ch in brackets:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest


def check_shape(doc: object, path: str, error_cls: type[ActCacheError]) -> None:
    """Refuse a parsed document nested deeper than MAX_DEPTH or holding more than MAX_NODES values
    (iterative: a self-referencing YAML structure reaches the depth bound and stops)."""
    todo = [(doc, 1)]
    n = 0
    while todo:
        obj, depth = todo.pop()
        n += 1
        if depth > MAX_DEPTH:
            raise error_cls(f"{path}: nested more than {MAX_DEPTH} levels deep; flatten the document.")
        if n > MAX_NODES:
            raise error_cls(f"{path}: more than {MAX_NODES:,} values (after YAML aliases); shorten the document.")
        if isinstance(obj, dict):
            todo.extend((v, depth + 1) for v in obj.values())
            todo.extend((k, depth + 1) for k in obj if isinstance(k, tuple))
        elif isinstance(obj, (list, tuple)):
            todo.extend((v, depth + 1) for v in obj)


def _too_deep(path: str, error_cls: type[ActCacheError]) -> ActCacheError:
    return error_cls(f"{path}: nested more than {MAX_DEPTH} levels deep; flatten the document.")


def parse_json(raw: bytes, path: str, error_cls: type[ActCacheError], what: str = "JSON file") -> object:
    """Parse JSON bytes within the bounds; every failure is one ``error_cls`` line naming ``path``."""
    text = decode_utf8(raw, path, error_cls, what)
    if text_depth(text) > MAX_DEPTH:
        raise _too_deep(path, error_cls)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise error_cls(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}).") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer of more than 4300 digits
        raise error_cls(f"{path}: not valid JSON ({err}).") from None
    return doc  # no aliases in JSON: the size and the bracket nesting bound it


def load_json_file(path: str, error_cls: type[ActCacheError], what: str = "JSON file") -> object:
    return parse_json(read_doc_bytes(path, error_cls, what), path, error_cls, what)


def parse_yaml(raw: bytes, path: str, error_cls: type[ActCacheError], what: str = "YAML file") -> object:
    """Parse YAML bytes (safe loader) within the bounds; every failure is one ``error_cls`` line."""
    import yaml

    text = decode_utf8(raw, path, error_cls, what)
    if text_depth(text) > MAX_DEPTH:  # flow nesting costs PyYAML quadratic time: refuse it unparsed
        raise _too_deep(path, error_cls)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise error_cls(f"{path}: not valid YAML{at}: {problem}.") from None
    except (ValueError, OverflowError, TypeError) as err:  # a date with month 13, a 5000-digit integer
        raise error_cls(f"{path}: a value YAML cannot read ({type(err).__name__}: {err}); quote it.") from None
    except RecursionError:
        raise _too_deep(path, error_cls) from None
    check_shape(doc, path, error_cls)
    return doc


def load_yaml_file(path: str, error_cls: type[ActCacheError], what: str = "YAML file") -> object:
    return parse_yaml(read_doc_bytes(path, error_cls, what), path, error_cls, what)
