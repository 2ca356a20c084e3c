"""Where one block of one KV-cache group lives in the worker's KV tensors.

vLLM hands ``register_kv_caches`` one tensor per attention layer. Their shapes depend on
the backend and layout: ``(2, num_blocks, block_size, heads, head_size)`` (K and V
apart), ``(num_blocks, 2, ...)``, MLA's ``(num_blocks, block_size, latent)``, or views
into one cross-layer tensor whose block dimension is outermost (``BLHNC``). The
connector stores one gcache object per (group, block): the bytes of that block in every
layer of the group, in the group's layer order.

``GroupLayout`` finds each layer's block dimension (the dimension of size
``num_blocks``), cuts one block of the layer into its contiguous byte runs, and merges
runs that stay adjacent for every block (same storage, same block stride). When a block
is one run (a block-outermost layout, or one layer per group with a block-major shape)
the SDK reads and writes it in place (``direct``); otherwise a transfer gathers the runs
into one host staging buffer, or scatters them from it (one extra copy): on the CPU one
``gcache.native.copy_spans`` call per storage moves every run of every block of the
transfer with the GIL released; on a GPU, one torch copy per run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple, Sequence

from gcache.native import copy_spans

if TYPE_CHECKING:
    import torch


class Run(NamedTuple):
    """``length`` bytes at ``offset + block * stride`` in storage number ``storage``."""

    storage: int
    offset: int
    length: int
    stride: int


def _runs_of(t: "torch.Tensor", storage: int, elsize: int) -> list[tuple[int, int, int]]:
    """(storage, byte offset, length) runs of a tensor, in logical order."""
    if t.is_contiguous():
        return [(storage, t.storage_offset() * elsize, t.numel() * elsize)]
    out: list[tuple[int, int, int]] = []
    for i in range(t.shape[0]):
        out.extend(_runs_of(t[i], storage, elsize))
    return out


class GroupLayout:
    """One group's block -> byte runs map, over the worker's registered tensors."""

    def __init__(self, tensors: Sequence["torch.Tensor"], num_blocks: int,
                 device_buffers: bool = False) -> None:
        """``device_buffers``: the SDK's transport takes device (CUDA) memory (nixl), so
        a one-run block on a GPU is read and written in place too."""
        if not tensors:
            raise ValueError("a KV-cache group with no layers")
        self.storages: list["torch.Tensor"] = []  # uint8 views of whole storages
        self.device = tensors[0].device
        index: dict[int, int] = {}
        runs: list[Run] = []
        for t in tensors:
            bdim = _block_dim(t, num_blocks)
            key = t.untyped_storage().data_ptr()
            if key not in index:
                index[key] = len(self.storages)
                self.storages.append(_storage_bytes(t))
            elsize = t.element_size()
            stride = t.stride(bdim) * elsize
            for s, off, n in _runs_of(t.select(bdim, 0), index[key], elsize):
                last = runs[-1] if runs else None
                if last and last.storage == s and last.stride == stride \
                        and last.offset + last.length == off:
                    runs[-1] = last._replace(length=last.length + n)
                else:
                    runs.append(Run(s, off, n, stride))
        self.runs = runs
        self.block_bytes = sum(r.length for r in runs)
        self.direct = len(runs) == 1 and (self.device.type == "cpu" or device_buffers)
        # host storages as flat memoryviews: a slice of one costs far less than a tensor
        # slice, here and in the SDK's buffer checks (a 32k-token prefix has 2k blocks)
        self._host = [memoryview(st.numpy()) if self.device.type == "cpu" else None
                      for st in self.storages]

    def view(self, block: int) -> "torch.Tensor | memoryview":
        """The block's bytes in place (``direct`` layouts only)."""
        r = self.runs[0]
        start = r.offset + block * r.stride
        host = self._host[r.storage]
        if host is not None:
            return host[start:start + r.length]
        return self.storages[r.storage][start:start + r.length]

    def gather(self, block: int, out: "torch.Tensor") -> None:
        """Copy the block's runs into ``out`` (uint8, ``block_bytes`` long)."""
        pos = 0
        for r in self.runs:
            start = r.offset + block * r.stride
            out[pos:pos + r.length].copy_(self.storages[r.storage][start:start + r.length])
            pos += r.length

    def scatter(self, block: int, src: "torch.Tensor") -> None:
        """Copy ``src`` (uint8, ``block_bytes`` long) into the block's runs."""
        pos = 0
        for r in self.runs:
            start = r.offset + block * r.stride
            self.storages[r.storage][start:start + r.length].copy_(src[pos:pos + r.length])
            pos += r.length


    def move(self, pairs: Sequence[tuple[int, int]], staging: memoryview, to_kv: bool,
             timeout_s: float = 60.0) -> None:
        """Move whole blocks between the KV tensors and ``staging`` (flat bytes): for each
        ``(i, block)``, staging bytes ``[i * block_bytes, (i + 1) * block_bytes)`` <->
        the block's runs. ``to_kv``: staging -> KV (a load), else KV -> staging (a save)."""
        if self.device.type != "cpu":
            import torch

            flat = torch.frombuffer(staging, dtype=torch.uint8)
            for i, b in pairs:
                part = flat[i * self.block_bytes:(i + 1) * self.block_bytes]
                if to_kv:
                    self.scatter(b, part.to(self.device))
                else:
                    out = torch.empty(self.block_bytes, dtype=torch.uint8, device=self.device)
                    self.gather(b, out)
                    part.copy_(out.cpu())
            return
        per: dict[int, list[tuple]] = {}
        for i, b in pairs:
            pos = i * self.block_bytes
            for r in self.runs:
                per.setdefault(r.storage, []).append(
                    (staging[pos:pos + r.length], r.offset + b * r.stride, r.length, False))
                pos += r.length
        stop = time.monotonic() + timeout_s
        for s, spans in per.items():
            st = self.storages[s]
            copy_spans(spans, st.data_ptr(), st.numel(), not to_kv, stop)


def _block_dim(t: "torch.Tensor", num_blocks: int) -> int:
    dims = [d for d in range(t.dim()) if t.shape[d] == num_blocks]
    if not dims:
        raise ValueError(f"no dimension of size num_blocks={num_blocks} in a KV tensor of "
                         f"shape {tuple(t.shape)}: this layout is not supported")
    return max(dims, key=t.stride)  # on a tie of sizes, the block dim strides widest


def _storage_bytes(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
