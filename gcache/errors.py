"""Every gcache exception, under one base class.

Runtime faults on the data path are ``Status`` values (see ``gcache.status``), never
exceptions: the SDK turns the exceptions below into a per-key status before a caller
sees them. The exceptions are for setup faults and for the layers under the SDK.

Which ones a caller may treat as a miss (the data is simply not available now; retry
later or recompute) and which ones mean "fix something first":

==================  ==============  ===================================================
exception           treat as miss?  raised when
==================  ==============  ===================================================
GCacheError         —               base class; catch it to catch everything below
ConfigError         no              a config value is missing, malformed or out of range
AuthError           no              the server or master refused the credential, token or
                                    certificate: fix the credential
ProtocolError       yes             a peer sent a frame that breaks wire protocol v1
TransportTimeout    yes             an exchange ran past its deadline
MasterUnavailable   yes             no master answered; routing keeps its last view
MasterError         no              a master answered with an error (bad request, 404)
NixlUnavailable     no              the NIXL library or its agent cannot be used here
ArenaError          no              the shared-memory arena cannot be created or mapped
DiskError           no              the NVMe tier cannot be set up (bad geometry, in use)
SnapshotRefused     no              a Raft snapshot failed its schema check
WiringError         no              components were put together wrongly (a hook attached
                                    twice, locks taken against their order): a bug
ServerStartError    no              a gcache-server cannot be built: credentials, a bind,
                                    the arena, the disk tier or nixl refused (the message
                                    says which, and what to fix)
==================  ==============  ===================================================
"""

from __future__ import annotations

__all__ = [
    "GCacheError", "ConfigError", "AuthError", "ProtocolError", "TransportTimeout",
    "MasterUnavailable", "MasterError", "NixlUnavailable", "ArenaError", "DiskError",
    "SnapshotRefused", "WiringError", "ServerStartError", "MISS_ERRORS",
]


class GCacheError(Exception):
    """Base class for every gcache exception."""


class ConfigError(GCacheError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class ProtocolError(GCacheError):
    """A peer sent a frame that violates wire protocol v1.

    ``status`` is the per-frame status the server replies with before it
    closes the connection.
    """

    def __init__(self, message: str, status: int = 11) -> None:
        super().__init__(message)
        self.status = status


class AuthError(GCacheError):
    """The credential, token or certificate was refused (at AUTH, or by a master)."""


class TransportTimeout(GCacheError):
    """An exchange with a server ran past its deadline."""


class MasterUnavailable(GCacheError):
    """No master answered (or every answer was an error)."""


class MasterError(GCacheError):
    """A master answered an API call with an HTTP error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code = code
        self.message = message


class NixlUnavailable(GCacheError, RuntimeError):
    """The NIXL library (or a usable backend) is not available on this host."""


class ArenaError(GCacheError, RuntimeError):
    """The shared-memory arena cannot be created, mapped or validated."""


class DiskError(GCacheError, RuntimeError):
    """A setup fault of the disk tier (bad geometry, directory in use)."""


class SnapshotRefused(GCacheError, ValueError):
    """A Raft snapshot is not one this master wrote: refused, nothing run."""


class WiringError(GCacheError, RuntimeError):
    """Components were put together wrongly (a bug in the caller, never a runtime fault):
    a tier's hooks attached twice, or locks taken against their documented order."""


class ServerStartError(GCacheError, RuntimeError):
    """A gcache-server could not be built (``gcache.server.app.Server``); nothing it
    built is left open. ``gcache-server`` exits with ``gcache-server: <message>``."""


#: The exceptions a caller may treat as a miss (see the table above).
MISS_ERRORS: tuple[type[GCacheError], ...] = (
    ProtocolError, TransportTimeout, MasterUnavailable)
