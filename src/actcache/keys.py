"""Config keys declared once: a dataclass field whose metadata says everything about the key.

    lr: float = key(4e-4, "Adam learning rate", scope="sae", gt=0)

The annotation gives the type, the field default the default (``key(required=True)``: none), and
:class:`Key` the rest: ``help`` (one line), ``scope`` (where it applies; each config module names
its scopes), ``hashed`` (enters the identity hash: the cache hash for experiment keys, the sae_id
for train keys), ``choices``, bounds (``ge``, ``gt``, ``le``, ``lt``), length, pattern and an example.

``late=True`` marks a key added after ids were first issued: it enters an id only while set to a
value other than its default, so every existing id stays byte-identical. Give it to every new key.

From these declarations come the validation (:func:`coerce`), the JSON schemas in
workflow/schemas/ and the key tables of config/README.md (scripts/gen_config_docs.py writes both).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from typing import Any

from actcache.errors import ConfigError

# A number YAML 1.1 reads as a string (``3e-4``, ``1e8``); underscores are digit separators.
NUMBER_RE = r"^[+-]?([\d_]+\.?[\d_]*|\.[\d_]+)([eE][+-]?\d+)?$"
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class ListOf:
    """A list (YAML) stored as a tuple, of items of one type."""

    item: type


@dataclasses.dataclass(frozen=True)
class Key:
    help: str
    scope: str
    hashed: bool = True
    late: bool = False
    choices: tuple = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_len: int | None = None  # items of a list, characters of a string
    unique: bool = False
    pattern: str | None = None
    example: Any = None
    schema: Any = None  # a function returning the JSON schema, for a section validated elsewhere


@dataclasses.dataclass(frozen=True)
class Decl:
    """One declared key: its name, allowed types (None: null), default (MISSING: required), Key."""

    name: str
    types: tuple
    default: Any
    key: Key

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    def example(self) -> Any:
        if self.key.example is not None:
            return self.key.example
        if self.key.choices:
            return self.key.choices[0]
        if self.required or dataclasses.is_dataclass(self.default):
            return None
        return self.default


def key(default: Any = _MISSING, help: str = "", *, scope: str, required: bool = False, **meta: Any):
    """A dataclass field declaring a config key (see the module docstring)."""
    if required == (default is not _MISSING):
        raise TypeError("give a default or required=True, not both")
    kw = {} if required else {"default": default}
    return dataclasses.field(metadata={"key": Key(help=help, scope=scope, **meta)}, **kw)


@functools.cache
def declared(cls: type) -> dict[str, Decl]:
    """name -> Decl for every field of ``cls`` declared with :func:`key`, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if "key" in f.metadata:
            out[f.name] = Decl(f.name, _types(hints[f.name]), f.default, f.metadata["key"])
    return out


def _types(tp: Any) -> tuple:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(t for arg in typing.get_args(tp) for t in _types(arg))
    if tp is type(None):
        return (None,)
    if typing.get_origin(tp) in (tuple, list):
        return (ListOf(typing.get_args(tp)[0]),)
    return (typing.get_origin(tp) or tp,)


def is_section(t: Any) -> bool:
    """Whether a declared type is a nested section (a dataclass of its own keys)."""
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def type_names(types_: tuple) -> str:
    return " or ".join(_type_name(t) for t in types_)


def _type_name(t: Any) -> str:
    if isinstance(t, ListOf):
        return f"list of {t.item.__name__}"
    if t is dict or is_section(t):
        return "mapping"
    return {None: "null", typing.Any: "any"}.get(t) or t.__name__


# ---- validation ---------------------------------------------------------------------------------


def coerce(decl: Decl, value: Any, where: str, name: str | None = None) -> Any:
    """``value`` as written for ``decl`` -> the checked value, or a one-line ConfigError naming
    ``where`` (file and section), the key as written (``name``), the value and a valid example."""
    name = name or decl.name
    value = _typed(decl, value, where, name)
    if value is not None:
        problem = _problem(decl.key, value)
        if problem:
            _fail(decl, where, name, problem, value)
    return value


def _typed(decl: Decl, v: Any, where: str, name: str) -> Any:
    ok = decl.types
    if v is None:
        if None in ok or typing.Any in ok:
            return None
        _fail(decl, where, name, "may not be null", v)
    if typing.Any in ok:
        return v
    lists = [t for t in ok if isinstance(t, ListOf)]
    if lists:
        items = list(v) if isinstance(v, list | tuple) else [v]  # one item stands for a list of one
        item = dataclasses.replace(decl, types=(lists[0].item,))
        if all(_scalar(item.types, x) is not _BAD for x in items):
            return tuple(_scalar(item.types, x) for x in items)
    else:
        out = _scalar(ok, v)
        if out is not _BAD:
            return out
    _fail(decl, where, name, f"must be {type_names(ok)}", v, show_type=True)


_BAD = object()


def _scalar(ok: tuple, v: Any) -> Any:
    """``v`` as one of the types ``ok`` (YAML reads ``3e-4`` as a string: accepted), or _BAD."""
    numeric = int in ok or float in ok
    if numeric and isinstance(v, str) and _NUMBER.match(v.strip().replace("_", "")):
        v = float(v.replace("_", ""))
    if int in ok and float not in ok and isinstance(v, float) and v.is_integer():
        v = int(v)  # n_tokens: 1.0e8
    if isinstance(v, bool):
        return v if bool in ok else _BAD
    if isinstance(v, int) and int in ok:
        return v
    if isinstance(v, int | float) and float in ok:
        return float(v) if math.isfinite(v) else _BAD
    if isinstance(v, str) and str in ok:
        return v
    if isinstance(v, dict) and any(t is dict or is_section(t) for t in ok):
        return v  # a nested section: its own keys are read by its own declaration
    return _BAD


def _problem(k: Key, v: Any) -> str | None:
    """What is wrong with a well-typed value (None when nothing)."""
    if k.choices and v not in k.choices:
        return f"must be one of {', '.join(map(str, k.choices))}"
    if isinstance(v, tuple):
        if k.min_len is not None and len(v) < k.min_len:
            return f"needs at least {k.min_len} item(s)"
        if k.unique and len(set(v)) != len(v):
            return "repeats an item"
        bad = [x for x in v if _problem(dataclasses.replace(k, choices=(), min_len=None, unique=False), x)]
        return f"must hold items {_range(k)}" if bad else None
    if isinstance(v, str):
        if k.min_len is not None and len(v) < k.min_len:
            return f"needs at least {k.min_len} character(s)"
        if k.pattern is not None and not re.match(k.pattern, v):
            return f"must match {k.pattern}"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    k_ok = (
        (k.ge is None or v >= k.ge)
        and (k.gt is None or v > k.gt)
        and (k.le is None or v <= k.le)
        and (k.lt is None or v < k.lt)
    )
    if not k_ok:
        return f"must be {_range(k)}"
    return None


def _range(k: Key) -> str:
    lo = f"[{k.ge:g}" if k.ge is not None else f"({k.gt:g}" if k.gt is not None else None
    hi = f"{k.le:g}]" if k.le is not None else f"{k.lt:g})" if k.lt is not None else None
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return f"{'>=' if k.ge is not None else '>'} {lo[1:]}"
    return f"{'<=' if k.le is not None else '<'} {hi[:-1]}"


def _fail(decl: Decl, where: str, name: str, problem: str, v: Any, show_type: bool = False) -> typing.NoReturn:
    null = " (or null)" if None in decl.types and problem != "may not be null" and not show_type else ""
    got = f"{v!r} ({type(v).__name__})" if show_type else repr(v)
    example = decl.example()
    fix = f"; e.g. `{name.rsplit('.', 1)[-1]}: {_yaml(example)}`" if example is not None else ""
    about = f" ({decl.key.help})" if len(decl.key.help) <= 80 else ""  # long helps belong in the docs
    raise ConfigError(f"{where}: key '{name}' {problem}{null}, got {got}{fix}{about}.")


def _yaml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(map(_yaml, v)) + "]"
    return str(v)


def check_keys(doc: dict, allowed: dict | set, where: str, prefix: str = "", retired: dict | None = None) -> None:
    """Fail on the first key of ``doc`` not in ``allowed``, suggesting a close spelling, or saying
    what replaced it (``retired``: key -> what to do instead)."""
    unknown = [k for k in doc if k not in allowed]
    if unknown:
        bad = str(unknown[0])
        if retired and bad in retired:
            raise ConfigError(f"{where}: key '{prefix}{bad}' was removed: {retired[bad]} (config/README.md).")
        close = [k for k in allowed if k.replace("_", "") == bad.replace("_", "").lower()]
        close = close or difflib.get_close_matches(bad.lower(), list(allowed), n=1, cutoff=0.7)
        hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
        # a long list hides the one likely spelling: past a dozen keys, name where they are listed
        listed = f"Allowed: {', '.join(sorted(allowed))}" if len(allowed) <= 12 or not close else "Every key"
        raise ConfigError(f"{where}: unknown key '{prefix}{bad}'.{hint} {listed} (config/README.md).")


def read_section(doc: Any, cls: type, where: str, prefix: str = "") -> dict:
    """A mapping of ``cls``'s keys -> {name: checked value}, defaults filled in."""
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{where}: '{prefix.rstrip('.') or 'top level'}' must be a mapping, got {type(doc).__name__}."
        )
    decls = declared(cls)
    check_keys(doc, decls, where, prefix)
    out = {}
    for name, decl in decls.items():
        if name in doc:
            out[name] = coerce(decl, doc[name], where, prefix + name)
        elif decl.required:
            raise ConfigError(
                f"{where}: missing required key '{prefix}{name}' ({decl.key.help}; see config/README.md)."
            )
        else:
            out[name] = decl.default
    return out


def check_fields(obj: Any, where: str, prefix: str = "") -> None:
    """Check (and normalise, e.g. a list into a tuple) the declared fields of a frozen dataclass."""
    for name, decl in declared(type(obj)).items():
        value = coerce(decl, getattr(obj, name), where, prefix + name)
        if value is not getattr(obj, name):
            object.__setattr__(obj, name, value)
