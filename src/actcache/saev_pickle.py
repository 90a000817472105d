"""saev's ``data`` field (base64 of a pickled dataset config), written and shown without unpickling.

    dataset_pickle("saev.data.datasets", "ImgFolder", {"root": Path("/imgs")})  # bytes saev can unpickle
    describe_pickle(raw)   # {"class": "saev.data.datasets.ImgFolder", "fields": {"root": "/imgs"}} or None

Writing: the opcodes of ``cls.__new__(cls)`` followed by ``__dict__.update(fields)`` (what pickle
does for a plain dataclass instance), built by hand so the class need not be importable here; the
field values are str, int, float, bool, None and paths (``pathlib.PosixPath(str)``).
Reading: :func:`pickletools.genops` walks the opcodes and a small symbolic stack evaluates only
the operations that build such a value; anything else (another callable, a class we would have to
run) makes the whole field opaque (None). Nothing is imported or called.
"""

from __future__ import annotations

import io
import pathlib
import pickletools
import struct

PROTOCOL = 2


def _value(v: object) -> bytes:
    if v is None:
        return b"N"
    if v is True:
        return b"\x88"
    if v is False:
        return b"\x89"
    if isinstance(v, int):
        if -(2**31) <= v < 2**31:
            return b"J" + struct.pack("<i", v)
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw
    if isinstance(v, float):
        return b"G" + struct.pack(">d", v)
    if isinstance(v, str):
        raw = v.encode("utf-8")
        return b"X" + struct.pack("<I", len(raw)) + raw
    if isinstance(v, pathlib.PurePath):
        return _global("pathlib", "PosixPath") + b"(" + _value(str(v)) + b"tR"
    raise TypeError(f"cannot write {type(v).__name__} into a dataset pickle")


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def dataset_pickle(module: str, name: str, fields: dict) -> bytes:
    """Pickle bytes that unpickle to an instance of ``module.name`` with ``fields`` as its attributes."""
    out = io.BytesIO()
    out.write(b"\x80" + bytes([PROTOCOL]) + _global(module, name) + b")\x81")  # cls.__new__(cls)
    out.write(b"}(")
    for key, v in fields.items():
        out.write(_value(str(key)) + _value(v))
    out.write(b"ub.")  # SETITEMS, BUILD, STOP
    return out.getvalue()


class _Opaque(Exception):
    """The pickle does something other than build a plain object of simple values."""


_PATHS = {("pathlib", n) for n in ("Path", "PosixPath", "PurePath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
_SIMPLE = {"NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT",
           "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
           "BINUNICODE8"}  # fmt: skip


class _Global(tuple):
    pass


class _Object(dict):
    """An instance of a class named in the pickle: its qualified name and the fields set on it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def _evaluate(raw: bytes) -> object:
    stack: list = []
    marks: list[int] = []
    memo: dict = {}

    def pop_mark() -> list:
        if not marks:
            raise _Opaque
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    for op, arg, _ in pickletools.genops(raw):
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            break
        if name in _SIMPLE:
            stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
        elif name == "MARK":
            marks.append(len(stack))
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "STACK_GLOBAL":
                mod, qual = stack.pop(-2), stack.pop()
            else:
                mod, qual = arg.split(" ", 1)
            if not (isinstance(mod, str) and isinstance(qual, str)):
                raise _Opaque
            stack.append(_Global((mod, qual)))
        elif name in ("EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            n = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}.get(name)
            items = pop_mark() if n is None else [stack.pop() for _ in range(n)][::-1]
            stack.append(tuple(items))
        elif name in ("EMPTY_LIST", "EMPTY_DICT"):
            stack.append([] if name == "EMPTY_LIST" else {})
        elif name in ("LIST", "DICT"):
            items = pop_mark()
            stack.append(items if name == "LIST" else dict(zip(items[::2], items[1::2], strict=True)))
        elif name in ("APPEND", "APPENDS"):
            items = [stack.pop()] if name == "APPEND" else pop_mark()
            if not isinstance(stack[-1], list):
                raise _Opaque
            stack[-1].extend(items)
        elif name in ("SETITEM", "SETITEMS"):
            items = stack[-2:] if name == "SETITEM" else pop_mark()
            if name == "SETITEM":
                del stack[-2:]
            if not isinstance(stack[-1], dict) or isinstance(stack[-1], _Object):
                raise _Opaque
            stack[-1].update(zip(items[::2], items[1::2], strict=True))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "NEWOBJ":
            args, cls = stack.pop(), stack.pop()
            if not isinstance(cls, _Global) or args != ():
                raise _Opaque
            stack.append(_Object(".".join(cls)))
        elif name == "REDUCE":
            args, fn = stack.pop(), stack.pop()
            if tuple(fn) not in _PATHS or not all(isinstance(a, str) for a in args):
                raise _Opaque  # calling anything but a path constructor would run code
            stack.append(str(pathlib.PurePosixPath(*args)))
        elif name == "BUILD":
            state = stack.pop()
            if not isinstance(stack[-1], _Object) or not isinstance(state, dict):
                raise _Opaque
            stack[-1].update(state)
        else:
            raise _Opaque
    if len(stack) != 1:
        raise _Opaque
    return stack[0]


def _simple(v: object) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_simple(x) for x in v)
    if isinstance(v, dict) and not isinstance(v, _Object):
        return all(isinstance(k, str) and _simple(x) for k, x in v.items())
    return v is None or isinstance(v, (str, int, float, bool))


def describe_pickle(raw: bytes) -> dict | None:
    """{"class": qualified name or None (a plain dict), "fields": {name: simple value}} of a pickled
    dataset config, read from its opcodes only; None when it is anything else (opaque)."""
    try:
        value = _evaluate(raw)
    except (_Opaque, ValueError, IndexError, KeyError, TypeError, EOFError):
        return None
    if isinstance(value, _Object) and _simple(dict(value)):
        return {"class": value.name, "fields": dict(value)}
    if isinstance(value, dict) and not isinstance(value, _Object) and _simple(value):
        return {"class": None, "fields": value}
    return None
