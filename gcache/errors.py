"""Exceptions for setup faults (bad config, bad arguments, protocol violations).

Runtime faults on the data path are ``Status`` values (see ``gcache.status``),
never exceptions: a caller of the SDK can treat any non-OK status as a miss.
"""

from __future__ import annotations


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
    """The token handshake failed."""
