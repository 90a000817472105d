"""Every error a user can cause is an ActCacheError subclass with an actionable message.

The CLI catches ActCacheError and prints its message (no traceback), exiting with the error's
``exit_status``: 2 for an error the user must fix, which a retry would meet again (the workflow does
not retry it), EXIT_RETRY for a stop a retry can outlive (a preemption, a batch timeout).
"""

from __future__ import annotations

import errno

EXIT_USER = 2
EXIT_RETRY = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, retrying may succeed
# errnos of an OSError that a retry can outlive (a flaky or lagging shared filesystem)
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR})


class ActCacheError(Exception):
    """Base class: something the user can fix (a file, a field, a value)."""

    exit_status = EXIT_USER


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

    exit_status = EXIT_RETRY


class TrainError(ActCacheError):
    """SAE training failed because of its input (config, data)."""


def os_error_text(err: OSError) -> str:
    """An OSError as a user reads it: "No space left on device (ENOSPC)"."""
    code = errno.errorcode.get(err.errno) if err.errno is not None else None
    text = err.strerror or str(err)
    return f"{text} ({code})" if code else text
