"""Every error a user can cause is an ActCacheError subclass with an actionable message.

The CLI catches ActCacheError and prints its message (no traceback), exiting with status 2.
"""

from __future__ import annotations

import errno


class ActCacheError(Exception):
    """Base class: something the user can fix (a file, a field, a value)."""


class ConfigError(ActCacheError):
    """A configuration value (YAML file, dataclass field, CLI flag) is invalid."""


class ProtocolError(ActCacheError):
    """A cache directory does not follow the sharded-activation protocol v1."""


class VersionError(ProtocolError):
    """A cache was written with a protocol version this code cannot read."""


class CacheIncompleteError(ProtocolError):
    """A cache directory is missing shards or shards.json (dump not finished)."""


class DumpError(ActCacheError):
    """Computing or writing activations failed."""


class LoaderError(ActCacheError):
    """A data loader failed (a reader crashed, bad options)."""


class BatchTimeoutError(LoaderError):
    """No batch arrived within batch_timeout_s."""


class TrainError(ActCacheError):
    """SAE training failed because of its input (config, data)."""


def os_error_text(err: OSError) -> str:
    """An OSError as a user reads it: "No space left on device (ENOSPC)"."""
    code = errno.errorcode.get(err.errno) if err.errno is not None else None
    text = err.strerror or str(err)
    return f"{text} ({code})" if code else text
