"""gcache SDK: ``from gcache.sdk import Client, Status``."""

from gcache.sdk.client import Client
from gcache.status import Status

__all__ = ["Client", "Status"]
