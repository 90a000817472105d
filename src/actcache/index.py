"""Small frozen, typed index objects that name a location in a cache and round-trip through JSON.

    ActIndex(image=12, layer=10, token="all")   # every token of image 12 at layer 10 -> (T, D)
    ActIndex(image="all", layer=-2, token=0)    # the CLS vector of every image -> (N, D)

Each axis is a number or "all"; ``dim`` (a single activation dimension) is optional. ``layer`` is a
layer *value* as recorded in metadata.json (matched exactly), not a position.
"""

from __future__ import annotations

import dataclasses
import json

from actcache.errors import ConfigError

ALL = "all"
_AXES = ("image", "layer", "token", "dim")


def _check(name: str, v: object) -> None:
    if v == ALL and isinstance(v, str):
        return
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"ActIndex.{name} must be an integer or 'all', got {v!r}")
    if name != "layer" and v < 0:
        raise ConfigError(f"ActIndex.{name} must be >= 0 or 'all', got {v}")


@dataclasses.dataclass(frozen=True)
class ActIndex:
    image: int | str = ALL
    layer: int | str = ALL
    token: int | str = ALL
    dim: int | str = ALL

    def __post_init__(self) -> None:
        for name in _AXES:
            _check(name, getattr(self, name))

    @property
    def ndim(self) -> int:
        """Number of axes of the selected array (each 'all' keeps its axis)."""
        return sum(getattr(self, a) == ALL for a in _AXES)

    def to_dict(self) -> dict:
        return {a: getattr(self, a) for a in _AXES}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, doc: object) -> ActIndex:
        if not isinstance(doc, dict):
            raise ConfigError(f"ActIndex: expected an object with keys {_AXES}, got {doc!r}")
        unknown = set(doc) - set(_AXES)
        if unknown:
            raise ConfigError(f"ActIndex: unknown key(s) {sorted(unknown)}; allowed: {list(_AXES)}")
        return cls(**doc)

    @classmethod
    def from_json(cls, text: str) -> ActIndex:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise ConfigError(f"ActIndex: not JSON ({err.msg})") from None

    def replace(self, **kw) -> ActIndex:
        return dataclasses.replace(self, **kw)
