"""The caller's buffers as flat byte views, and the raw copies between them.

``as_view`` (``as_views`` for a batch) turns a memoryview, bytes, bytearray, numpy
array or torch tensor into a flat byte view with no copy (a CUDA tensor into a ``DeviceView``, for the nixl
transport). The transports move bytes with ``memmove`` between ``address_of`` views
and mapped memory, and the client checksums values with ``digest``. Pure functions
and one small record: any thread may call them; only ``memmove`` and ``digest`` take
time (they copy or hash ``n`` bytes, the GIL released for ``memmove``).
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np

from gcache.hashing import checksum
from gcache.native import byte_views


class DeviceView:
    """A flat byte range of a CUDA tensor; slices like a memoryview (for the dispatcher)."""

    __slots__ = ("t", "ptr", "dev")

    def __init__(self, flat: Any) -> None:  # flat: contiguous 1-D uint8 CUDA tensor
        self.t, self.ptr, self.dev = flat, int(flat.data_ptr()), int(flat.device.index or 0)

    def __len__(self) -> int:
        return int(self.t.numel())

    def __getitem__(self, sl: slice) -> "DeviceView":
        return DeviceView(self.t[sl])

    def to_host(self, addr: int, n: int) -> None:
        import torch

        host = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)))
        host.copy_(self.t[:n])

    def from_host(self, addr: int, n: int) -> None:
        import torch

        host = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)))
        self.t[:n].copy_(host)


def as_view(buf: Any, writable: bool, device: bool = False) -> Any:
    """A flat byte view of memoryview / bytes / numpy / torch tensor, no copy.

    CUDA tensors become a ``DeviceView`` when ``device`` (the nixl transport) allows it.
    """
    mod = type(buf).__module__
    if mod.startswith("torch"):
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous")
        import torch

        flat = buf.reshape(-1).view(torch.uint8) if buf.numel() else buf.reshape(-1)
        if buf.device.type != "cpu":
            if not device:
                raise ValueError("CUDA tensors need transport='nixl'; pass a CPU tensor")
            return DeviceView(flat)
        mv = memoryview(flat.numpy())
    else:
        mv = memoryview(buf)
    if not mv.contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError("destination buffer is read-only")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def as_views(bufs: Sequence[Any], writable: bool, device: bool = False) -> list:
    """``as_view`` of every buffer of a batch: host buffers in one native call
    (``gcache.native.byte_views``, same results and errors); a batch holding anything
    that call does not take (torch tensors) goes through ``as_view`` one by one."""
    try:
        return byte_views(bufs, writable)
    except TypeError:
        return [as_view(b, writable, device) for b in bufs]


def digest(buf: Any) -> int:
    """xxh3_64 of a flat byte view (host memory in place; a CUDA ``DeviceView`` is
    copied to the host first)."""
    if isinstance(buf, (memoryview, bytes, bytearray)):
        return checksum(buf)
    return checksum(buf.t.cpu().numpy())


def address_of(view: memoryview) -> int:
    """The address of a host byte view's first byte."""
    try:  # writable buffers: ~0.2 us, the export ends with the temporary
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only (bytes) or empty
        return np.frombuffer(view, dtype=np.uint8).ctypes.data


def memmove(dst_addr: int, src_addr: int, n: int) -> None:
    """Copy ``n`` bytes between two host addresses."""
    if n:
        ctypes.memmove(dst_addr, src_addr, n)  # a foreign call: the GIL is released
