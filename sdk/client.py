"""gcache SDK client: put/get/exists/delete/touch, batch, zero-copy and async forms.

This module is the public API only. How a call runs (docs/architecture.md, "SDK"):

* the user thread validates arguments and makes a ``Batch`` (batch.py), which cuts
  each key into work items (values larger than ``slice_bytes`` into slices); the
  ``Router`` (routing.py) maps each key to its owner on the consistent-hash ring of
  the current view and cuts each owner's items into frames (``Framing``, by data
  path); the ``Dispatcher`` (dispatcher.py) queues them on the owner's ``Lane``;
* one-hop: a synchronous call whose items make one frame for one server, of one
  item, at most ``one_hop_max_bytes``, or on a shm lane any get or put frame the
  arena moves (``one_sided_min_bytes`` or more: its bytes never cross the socket),
  runs that frame on the calling thread
  (blocked anyway) over an idle one-hop connection of the lane (``Lane.run_here``),
  under the same rules; async calls, bigger calls and calls finding every one-hop
  connection busy are queued. Follow-up frames (a large byte get's other slices, a
  NOT_OWNER re-route, a previous-owner read) always go through the queues;
* dispatch threads run the frames through their transports (transports/); every
  completion folds into the batch, per key (all slices) and per batch, and each key
  callback and each batch callback/future fires exactly once — on success, miss,
  timeout, peer death or close alike.

Failure semantics: every op has a deadline (``timeout_ms``). Past it the key's
result is ``Status.TIMEOUT`` (``None`` for byte-returning gets): a miss, never
an exception and never a hang. Faults are values; only bad arguments raise.

Sliced reads use the object version the server returns: all slices of one key
must come from the same version, otherwise the key is a ``CONFLICT`` miss, so
a reader never sees a mix of an old and a new object.
"""

from __future__ import annotations

import logging
import ssl
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Sequence

from gcache.credentials import bearer_of
from gcache.discovery import MasterClient
from gcache.errors import ConfigError
from gcache.protocol import Limits, Op
from gcache.status import Status
from gcache.view import View
from gcache.sdk.batch import (Batch, BatchCallback, BytesBatch, Checksums, IntoBatch,
                              KeyBatch, KeyCallback, PutBatch)
from gcache.sdk.buffers import as_view, as_views
from gcache.sdk.cuda_events import StreamCallbacks
from gcache.sdk.dispatcher import Dispatcher
from gcache.sdk import point
from gcache.sdk.metrics import SdkMetrics
from gcache.sdk.routing import Router
from gcache.sdk.settings import client_settings
from gcache.sdk.transports.base import Framing
from gcache.sdk.transports.factory import make_transport
from gcache.sdk.transports.tcp import TcpTransport

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    import numpy as np
    import torch

    Buffer = memoryview | bytearray | np.ndarray | torch.Tensor

log = logging.getLogger("gcache.sdk")

Key = str | bytes


class Client:
    """A gcache client. Thread-safe; share one per process.

    Args:
        servers: ``["host:port", ...]`` (or a comma-separated string).
        namespace: tenant / model / layout fingerprint; part of every key.
        timeout_ms: default deadline of every op.
        credential: ``"id:secret"``, a credential of the servers' credentials file (env
            ``GCACHE_CREDENTIAL``); it scopes what this client may do: an op on a
            namespace outside its grants answers ``Status.AUTH`` per key (the
            connection stays up). Also sent to the masters (``Bearer id:secret``).
            Wins over ``token`` when both are set.
        token: the legacy shared secret ('' = none): full rights on every namespace.
        masters: gcache-master API addresses; the client routes by their view, follows its
            epoch in the background and keeps routing on the last view if all are down.
            ``servers`` given as well only bootstrap routing until a master answers.
        slice_bytes, conns_per_server, queue_depth, frame_target_bytes,
        probe_interval_ms, connect_timeout_ms: dispatch tuning (see docs).
        transport: ``auto`` (shared memory when the server is on this host, else nixl
            when this host has an RDMA device and the server offers it, else TCP),
            ``tcp``, ``shm`` (co-located servers only) or ``nixl`` (one-sided
            READ/WRITE through NIXL; CUDA tensors allowed).
        nixl_bounce_bytes: registered staging buffer per nixl connection, for buffers
            not registered with ``register_buffer``. ``one_sided_min_bytes`` (config /
            ``GCACHE_ONE_SIDED_MIN_BYTES``): smaller frames go as plain GET/PUT.
        verify_checksums: check every value read against the server's xxh3 checksum once
            all its bytes landed (default on); a mismatch is a ``CORRUPT`` miss, never a
            hit. Puts always carry the value's checksum, and the server verifies it
            before the value becomes visible.
        tls: ``True`` to speak TLS to every server and master (verifying their
            certificates against ``tls_ca_file``, or the system store, and their names
            against the addresses dialed), or a ready ``ssl.SSLContext`` (used as is).
            Also on when ``tls_ca_file`` or ``tls_cert_file`` is set. Under TLS
            ``transport`` may be tcp, shm or auto (never nixl: its bytes bypass TLS).
        tls_ca_file: PEM CA bundle that signed the servers' and masters' certificates.
        tls_cert_file, tls_key_file: this client's certificate and key, for servers
            that require client certificates (mTLS).
        handoff_read_window_ms: for this long after the masters' ring changed (a server
            joined, drained, left), a get or exists that misses at a key's new owner asks
            its previous owner too (the most recent other owner of the key within the
            window that still holds data: up, joining or draining), within the op's
            deadline; deletes go to both (default 120000; 0 = never). Counted in
            ``counters`` (``handoff_reads``, ``handoff_read_hits``).
        background: run the dispatch threads at background CPU priority (``SCHED_IDLE``),
            and ask each server to run this client's connection threads so too (AUTH flag
            ``bg``): for bulk movers (the servers' handoff, prefetchers) that must not
            delay foreground requests on shared cores; see ``gcache.sched``. Default off.
        one_hop_max_bytes: a synchronous call (``get``, ``get_batch_into``, ``exists``,
            ``put``, ...) whose items make one frame for one server, of one key (slice)
            or of at most this many bytes (on a shm lane, a get or put frame of any
            size from ``one_sided_min_bytes``: its bytes never cross the socket), runs
            its IO on the calling thread when one of that server's ``conns_per_server``
            one-hop connections is idle: no dispatch-thread wake-ups (default 128 KiB;
            0 = never). Larger or multi-server calls, calls finding every one-hop
            connection busy, and every ``*_async`` call go through the dispatch
            threads. Same deadlines, statuses and exactly-once callbacks either way.
        stream_gets: ask servers for streamed GET replies (``"sr": 1``,
            docs/protocol.md): a frame's verified first items are sent while its later
            disk reads run. Same results, deadlines and statuses. Default off (measured
            at 64 KiB: more CPU per item, no throughput gained; see bench/RESULTS.md).
        metrics: ``True`` to count this client's calls in prometheus_client's default
            registry (which the application's own exporter serves), or a
            ``CollectorRegistry`` to count them there: ``gcache_client_items_total{op,
            result}`` (hits, and misses by cause) and ``gcache_client_op_seconds{op,
            transport}`` (see ``gcache.sdk.metrics``). Default off: nothing is counted.
        config_file: TOML file with ``[client]`` keys; env ``GCACHE_*`` overrides it,
            and explicit arguments override both.

    Raises:
        ConfigError: on bad arguments (setup faults raise; runtime faults are values).
    """

    def __init__(self, servers: Sequence[str] | str | None = None, *, namespace: str = "default",
                 timeout_ms: int | None = None, token: str | None = None,
                 credential: str | None = None,
                 masters: Sequence[str] | None = None, slice_bytes: int | None = None,
                 conns_per_server: int | None = None, queue_depth: int | None = None,
                 frame_target_bytes: int | None = None, probe_interval_ms: int | None = None,
                 connect_timeout_ms: int | None = None, config_file: str | None = None,
                 limits: Limits | None = None, transport: str | None = None,
                 nixl_bounce_bytes: int | None = None,
                 verify_checksums: bool | None = None,
                 tls: bool | ssl.SSLContext | None = None, tls_ca_file: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 handoff_read_window_ms: int | None = None,
                 background: bool | None = None,
                 one_hop_max_bytes: int | None = None,
                 stream_gets: bool | None = None,
                 metrics: bool | CollectorRegistry | None = None) -> None:
        if isinstance(servers, str):
            servers = servers.split(",")
        if isinstance(masters, str):
            masters = masters.split(",")
        if not servers and not masters:
            raise ConfigError("Client needs masters=[host:port, ...] or servers=[host:port, ...]")
        s = self._settings = client_settings(namespace, limits, tls, config_file, {
            "timeout_ms": timeout_ms, "token": token, "credential": credential,
            "slice_bytes": slice_bytes,
            "conns_per_server": conns_per_server, "queue_depth": queue_depth,
            "frame_target_bytes": frame_target_bytes, "probe_interval_ms": probe_interval_ms,
            "connect_timeout_ms": connect_timeout_ms, "transport": transport,
            "nixl_bounce_bytes": nixl_bounce_bytes, "verify_checksums": verify_checksums,
            "tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file,
            "tls_key_file": tls_key_file, "handoff_read_window_ms": handoff_read_window_ms,
            "background": background,
            "one_hop_max_bytes": one_hop_max_bytes, "stream_gets": stream_gets})
        cfg = self.config = s.config
        self.namespace, self.limits, self.transport = s.namespace, s.limits, s.transport
        self.timeout = s.timeout_s
        self.slice = int(cfg.slice_bytes)  # dispatch tuning, as configured (bench reports it)
        self.frame_target = int(cfg.frame_target_bytes)
        self.conns = int(cfg.conns_per_server)
        self.verify = bool(cfg.verify_checksums)
        self.one_hop_max = int(cfg.one_hop_max_bytes)
        self.one_sided_min = int(cfg.one_sided_min_bytes)
        self._checks = Checksums(self.verify)
        # reads refused by verify_checksums; the router adds handoff_reads/_read_hits
        self.counters = self._checks.counters
        self._streams = StreamCallbacks()  # the stream= forms (CUDA), made on first use
        self._closed = False
        self._dispatcher = Dispatcher(
            lambda address: make_transport(
                s.transport, address, s.token, s.limits, s.connect_timeout_s,
                int(cfg.nixl_bounce_bytes), int(cfg.one_sided_min_bytes), s.tls,
                background=bool(cfg.background), stream_gets=bool(cfg.stream_gets)),
            self._dial, conns=self.conns, queue_depth=cfg.queue_depth,
            probe_interval=cfg.probe_interval_ms / 1000.0,
            connect_timeout=s.connect_timeout_s,
            here_conns=self.conns if self.one_hop_max else 0)
        master = None
        if masters:
            master = MasterClient(masters, bearer_of(s.token),
                                  timeout_s=max(0.5, s.connect_timeout_s), tls=s.tls)
        self._router = Router(s.namespace, list(servers or []), master, self._dispatcher,
                              Framing(self.slice, self.frame_target, self.conns,
                                      s.limits.max_batch_items),
                              handoff_window_s=cfg.handoff_read_window_ms / 1000.0,
                              counters=self.counters, one_hop_max_bytes=self.one_hop_max,
                              one_sided_min_bytes=int(cfg.one_sided_min_bytes))
        self._router.start()
        self._metrics = SdkMetrics.for_registry(metrics) if metrics else None

    # ------------------------------------------------------------------ registration
    def register_buffer(self, buf: Any) -> bool:
        """Register ``buf`` (host memory, or a CUDA tensor) for zero-copy nixl transfers.

        Gets into and puts from registered memory move by one-sided READ/WRITE with no
        copy on this host (GPUDirect for CUDA memory where the NIC supports it);
        anything else goes through a per-connection bounce buffer. Register long-lived
        pools (KV host/device buffers), not per-request buffers: registration pins memory.

        Args:
            buf: a memoryview, numpy array or torch tensor (CPU or CUDA), contiguous.

        Returns:
            True once registered; False (and nothing done) when this client does not
            use nixl.

        Failure:
            ConfigError when NIXL cannot register it; ValueError for a bad buffer.
        """
        if not self._settings.nixl:
            return False
        from gcache.nixl_lib import NixlUnavailable
        from gcache.sdk.transports.nixl import REGISTRY

        try:
            return REGISTRY.add(buf)
        except NixlUnavailable as exc:
            raise ConfigError(str(exc)) from None

    def unregister_buffer(self, buf: Any) -> bool:
        """Undo ``register_buffer``; no transfer may be using ``buf``.

        Args:
            buf: a buffer passed to ``register_buffer``.

        Returns:
            True if it was registered; False otherwise, or when this client does not
            use nixl.

        Failure:
            ValueError for a bad buffer.
        """
        if not self._settings.nixl:
            return False
        from gcache.sdk.transports.nixl import REGISTRY

        return REGISTRY.remove(buf)

    # ------------------------------------------------------------------ routing
    def update_view(self, view: View) -> None:
        """Route by a new membership view (normally fed by the masters).

        Args:
            view: the members and epoch to route by; with masters, only a newer epoch
                than the current one is taken.

        Returns:
            None. Lanes to new members are made at once (their threads start).

        Failure:
            Never raises for a valid ``View``.
        """
        self._router.update(view)

    @property
    def view(self) -> View:
        """The membership view this client routes by now."""
        return self._router.view

    def owners(self, keys: Sequence[Key], group: Any = None, *,
               placement: Sequence[int] | None = None) -> list[str]:
        """The server each key routes to in the current view.

        Args:
            keys: the keys (str or bytes).
            group: as in the ops: one group for every key, or one per key (None = none).
            placement: internal, as in ``put_batch_from_async``: the keys' placement
                hashes, instead of ``group``.

        Returns:
            One ``host:port`` per key ('' when the view has no servers).

        Failure:
            ValueError for an empty or oversized key, or a group list of the wrong length.
        """
        router = self._router
        if placement is not None:
            return router.owners(_placement(placement, len(keys), group))
        return router.owners(router.hashes([self._key(k) for k in keys], group))

    # ------------------------------------------------------------------ puts
    def put_batch_from_async(self, keys: Sequence[Key], buffers: Sequence[Any], *,
                             group: Any = None, timeout_ms: int | None = None,
                             callback: BatchCallback | None = None,
                             on_key: KeyCallback | None = None, stream: Any = None,
                             if_absent: bool = False,
                             placement: Sequence[int] | None = None,
                             chain_parent: Key | None = None) -> Future[list[Status]]:
        """Store ``buffers[i]`` under ``keys[i]``, reading the buffers in place.

        The buffers must stay unchanged until the future completes.

        Args:
            keys: str or bytes keys, non-empty, at most ``max_key_bytes``.
            buffers: one value per key: bytes, bytearray, memoryview, numpy array or
                torch tensor (CUDA only with ``transport="nixl"``), contiguous.
            group: placement group: one for every key, or one per key; every key of a
                group lands on one server.
            timeout_ms: this call's deadline (default: the client's ``timeout_ms``).
            callback: called once with the list of statuses.
            on_key: called once per key with ``(index, key, status)`` as it finishes.
            stream: a torch.cuda.Stream: start only once the stream has reached this
                call, so the caller need not synchronize the work that fills the
                buffers (TIMEOUT for every key if it does not by the deadline).
            if_absent: store each key only if its server holds no object for it when the
                put commits (memory or disk); a key skipped that way is still OK. A put
                without it that commits first always wins (handoff copies use this).
                On nixl connections such puts go as plain PUTs (no one-sided ALLOC).
            placement: internal (the servers' handoff): each key's placement hash (u64
                ring position) as stored with its object, instead of ``group``: each key
                goes to that hash's owner and carries it (``ph``), so the owner keeps it
                and later readers of its group find it there. Not with ``group`` or
                ``stream``.
            chain_parent: the keys are consecutive pages of one prefix chain, in order,
                and this is the key of the page before the first (``""``/``b""``: the
                first key heads a chain). Each PUT frame of consecutive keys carries the
                key before its first (``"ch"``; a chain split over servers by ``group``
                links only within each server). A server whose ``eviction_policy`` is
                ``chains`` gives short new chains up first and chains tail first. None
                (default): nothing is said; every policy but ``chains`` ignores it.

        Returns:
            A Future of ``list[Status]``, one per key: OK, or a miss.

        Failure:
            Per-key statuses: TOO_LARGE, NO_SPACE, TIMEOUT, UNAVAILABLE, AUTH,
            QUEUE_FULL, CLOSED, ... — never raised. Bad arguments raise ValueError.
        """
        return self._put_from(keys, buffers, group=group, timeout_ms=timeout_ms,
                              callback=callback, on_key=on_key, stream=stream,
                              if_absent=if_absent, placement=placement,
                              chain_parent=chain_parent)

    def _put_from(self, keys: Sequence[Key], buffers: Sequence[Any], *, group: Any = None,
                  timeout_ms: int | None = None, callback: BatchCallback | None = None,
                  on_key: KeyCallback | None = None, stream: Any = None,
                  if_absent: bool = False, placement: Sequence[int] | None = None,
                  chain_parent: Key | None = None, here: bool = False) -> Future | Batch:
        """``put_batch_from_async``; ``here``: a synchronous call (see ``_start``: then
        the batch, for ``_wait``)."""
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers differ in length")
        if placement is not None:
            if stream is not None:
                raise ValueError("placement= does not go with stream=")
            placement = _placement(placement, len(keys), group)
        chain = None if chain_parent is None else self._key(chain_parent) if chain_parent \
            else b""
        if stream is not None:
            return self._put_after_stream(keys, buffers, stream, group, timeout_ms, callback,
                                          on_key, if_absent, chain)
        device = self._settings.device_buffers
        ks = self._keys(keys)
        views = as_views(buffers, writable=False, device=device)
        return self._start(PutBatch(ks, views, self.limits, self._deadline(timeout_ms),
                                    self._router, callback, on_key, if_absent, chain), group,
                           placement, here)

    def put_batch_from(self, keys: Sequence[Key], buffers: Sequence[Any], *,
                       group: Any = None, timeout_ms: int | None = None,
                       callback: BatchCallback | None = None, on_key: KeyCallback | None = None,
                       stream: Any = None, if_absent: bool = False,
                       placement: Sequence[int] | None = None,
                       chain_parent: Key | None = None) -> list[Status]:
        """Synchronous ``put_batch_from_async`` (same Args and Failure).

        Returns:
            ``list[Status]``, one per key.
        """
        fut = self._put_from(keys, buffers, group=group, timeout_ms=timeout_ms,
                             callback=callback, on_key=on_key, stream=stream,
                             if_absent=if_absent, placement=placement,
                             chain_parent=chain_parent, here=True)
        return self._wait(fut, len(keys), Status.TIMEOUT)

    def put_batch(self, keys: Sequence[Key], values: Sequence[bytes], *, group: Any = None,
                  timeout_ms: int | None = None, callback: BatchCallback | None = None,
                  on_key: KeyCallback | None = None, stream: Any = None,
                  if_absent: bool = False,
                  placement: Sequence[int] | None = None,
                  chain_parent: Key | None = None) -> list[Status]:
        """Store byte values: ``put_batch_from`` (same Args and Failure).

        Returns:
            ``list[Status]``, one per key.
        """
        return self.put_batch_from(keys, values, group=group, timeout_ms=timeout_ms,
                                   callback=callback, on_key=on_key, stream=stream,
                                   if_absent=if_absent, placement=placement,
                                   chain_parent=chain_parent)

    def put_batch_async(self, keys: Sequence[Key], values: Sequence[bytes], *,
                        group: Any = None, timeout_ms: int | None = None,
                        callback: BatchCallback | None = None,
                        on_key: KeyCallback | None = None, stream: Any = None,
                        if_absent: bool = False,
                        placement: Sequence[int] | None = None,
                        chain_parent: Key | None = None) -> Future[list[Status]]:
        """``put_batch_from_async`` for byte values (same Args, Returns and Failure)."""
        return self.put_batch_from_async(keys, values, group=group, timeout_ms=timeout_ms,
                                         callback=callback, on_key=on_key, stream=stream,
                                         if_absent=if_absent, placement=placement,
                                         chain_parent=chain_parent)

    def put(self, key: Key, value: Any, *, group: Any = None, timeout_ms: int | None = None,
            callback: BatchCallback | None = None, on_key: KeyCallback | None = None,
            stream: Any = None, if_absent: bool = False,
            placement: Sequence[int] | None = None,
            chain_parent: Key | None = None) -> Status:
        """Store one value (bytes or any buffer).

        Args:
            key, value: one key and its value; the keywords as ``put_batch_from_async``
                (``placement``: a list of the one key's hash; ``chain_parent``: the key
                of the page before this one in its chain).

        Returns:
            Its Status.

        Failure:
            A miss status (TIMEOUT, UNAVAILABLE, ...); bad arguments raise ValueError.
        """
        return self.put_batch_from([key], [value], group=group, timeout_ms=timeout_ms,
                                   callback=callback, on_key=on_key, stream=stream,
                                   if_absent=if_absent, placement=placement,
                                   chain_parent=chain_parent)[0]

    def put_async(self, key: Key, value: Any, *, group: Any = None,
                  timeout_ms: int | None = None, callback: BatchCallback | None = None,
                  on_key: KeyCallback | None = None, stream: Any = None,
                  if_absent: bool = False,
                  placement: Sequence[int] | None = None,
                  chain_parent: Key | None = None) -> Future[Status]:
        """``put`` as a Future of its Status (same Args and Failure)."""
        return _first(self.put_batch_from_async([key], [value], group=group,
                                                timeout_ms=timeout_ms, callback=callback,
                                                on_key=on_key, stream=stream,
                                                if_absent=if_absent, placement=placement,
                                                chain_parent=chain_parent))

    # ------------------------------------------------------------------ gets
    def get_batch_into_async(self, keys: Sequence[Key], buffers: Sequence[Any], *,
                             group: Any = None, timeout_ms: int | None = None,
                             callback: BatchCallback | None = None,
                             on_key: KeyCallback | None = None,
                             stream: Any = None) -> Future[list[Status]]:
        """Read each object straight into ``buffers[i]`` (exact size expected).

        Args:
            keys: str or bytes keys.
            buffers: one writable destination per key, exactly the object's size:
                bytearray, memoryview, numpy array or torch tensor (CUDA only with
                ``transport="nixl"``), contiguous.
            group, timeout_ms, callback, on_key: as ``put_batch_from_async``.
            stream: a torch.cuda.Stream: the batch callback and the future complete
                once the stream has passed the point where every key landed (per-key
                callbacks still fire per key).

        Returns:
            A Future of ``list[Status]``: OK, or MISS, SIZE_MISMATCH (the object is
            not ``len(buffer)`` bytes), CONFLICT, CORRUPT, TIMEOUT, UNAVAILABLE, ...
            A buffer whose key is not OK may hold partial bytes.

        Failure:
            Per-key statuses, never raised. Bad arguments raise ValueError.
        """
        return self._get_into(keys, buffers, group=group, timeout_ms=timeout_ms,
                              callback=callback, on_key=on_key, stream=stream)

    def _get_into(self, keys: Sequence[Key], buffers: Sequence[Any], *, group: Any = None,
                  timeout_ms: int | None = None, callback: BatchCallback | None = None,
                  on_key: KeyCallback | None = None, stream: Any = None,
                  here: bool = False) -> Future | Batch:
        """``get_batch_into_async``; ``here``: a synchronous call (see ``_start``)."""
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers differ in length")
        outer = None
        if stream is not None:
            callback, outer = self._streams.complete_after(
                stream, callback, self._deadline(timeout_ms) + 1.0)
        device = self._settings.device_buffers
        ks = self._keys(keys)
        views = as_views(buffers, writable=True, device=device)
        fut = self._start(IntoBatch(ks, views, self._checks, self._deadline(timeout_ms),
                                    self._router, callback, on_key), group, None, here)
        return fut if outer is None else outer

    def get_batch_into(self, keys: Sequence[Key], buffers: Sequence[Any], *,
                       group: Any = None, timeout_ms: int | None = None,
                       callback: BatchCallback | None = None,
                       on_key: KeyCallback | None = None, stream: Any = None) -> list[Status]:
        """Synchronous ``get_batch_into_async`` (same Args and Failure).

        Returns:
            ``list[Status]``, one per key.
        """
        if len(keys) == 1 and len(buffers) == 1 and callback is None and on_key is None \
                and stream is None:
            view = as_views(buffers, writable=True, device=self._settings.device_buffers)[0]
            if type(view) is memoryview and len(view) <= self.slice:  # point.py
                return [point.call(self, Op.GET, self._key(keys[0]), group,
                                   self._deadline(timeout_ms), view)]
        fut = self._get_into(keys, buffers, group=group, timeout_ms=timeout_ms,
                             callback=callback, on_key=on_key, stream=stream, here=True)
        return self._wait(fut, len(keys), Status.TIMEOUT)

    def get_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                        timeout_ms: int | None = None, callback: BatchCallback | None = None,
                        on_key: KeyCallback | None = None) -> Future[list[bytes | None]]:
        """Read values as new bytes.

        Args:
            keys, group, timeout_ms, callback, on_key: as ``put_batch_from_async``.

        Returns:
            A Future of ``list[bytes | None]``; ``None`` is a miss (absent, timeout,
            dead server, failed checksum).

        Failure:
            Misses are ``None``, never raised. Bad arguments raise ValueError.
        """
        return self._get_bytes(keys, group=group, timeout_ms=timeout_ms, callback=callback,
                               on_key=on_key)

    def _get_bytes(self, keys: Sequence[Key], *, group: Any = None,
                   timeout_ms: int | None = None, callback: BatchCallback | None = None,
                   on_key: KeyCallback | None = None, here: bool = False) -> Future | Batch:
        """``get_batch_async``; ``here``: a synchronous call (see ``_start``)."""
        return self._start(BytesBatch(self._keys(keys), self._checks,
                                      self._deadline(timeout_ms), self._router, callback,
                                      on_key, self.limits.max_value_bytes), group, None, here)

    def get_batch(self, keys: Sequence[Key], *, group: Any = None,
                  timeout_ms: int | None = None, callback: BatchCallback | None = None,
                  on_key: KeyCallback | None = None) -> list[bytes | None]:
        """Synchronous ``get_batch_async`` (same Args and Failure).

        Returns:
            ``list[bytes | None]``; ``None`` for every kind of miss.
        """
        if len(keys) == 1 and callback is None and on_key is None:  # point.py
            return [point.call(self, Op.GET, self._key(keys[0]), group,
                               self._deadline(timeout_ms))]
        fut = self._get_bytes(keys, group=group, timeout_ms=timeout_ms, callback=callback,
                              on_key=on_key, here=True)
        return self._wait(fut, len(keys), None)

    def get(self, key: Key, *, group: Any = None, timeout_ms: int | None = None,
            callback: BatchCallback | None = None,
            on_key: KeyCallback | None = None) -> bytes | None:
        """Read one value.

        Args:
            key: the key; the keywords as ``get_batch_async``.

        Returns:
            Its bytes, or ``None`` on a miss, a timeout or a dead server.

        Failure:
            Misses are ``None``; bad arguments raise ValueError.
        """
        return self.get_batch([key], group=group, timeout_ms=timeout_ms, callback=callback,
                              on_key=on_key)[0]

    def get_async(self, key: Key, *, group: Any = None, timeout_ms: int | None = None,
                  callback: BatchCallback | None = None,
                  on_key: KeyCallback | None = None) -> Future[bytes | None]:
        """``get`` as a Future of ``bytes | None`` (same Args and Failure)."""
        return _first(self.get_batch_async([key], group=group, timeout_ms=timeout_ms,
                                           callback=callback, on_key=on_key))

    # ------------------------------------------------------------------ keyed ops
    def exists_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                           timeout_ms: int | None = None, callback: BatchCallback | None = None,
                           on_key: KeyCallback | None = None) -> Future[list[bool]]:
        """Whether each key is stored now.

        Args:
            keys, group, timeout_ms, callback, on_key: as ``put_batch_from_async``.

        Returns:
            A Future of ``list[bool]``: False for absent, timeout or dead server.

        Failure:
            Misses are False, never raised. Bad arguments raise ValueError.
        """
        return self._keyed(Op.EXISTS, keys, group=group, timeout_ms=timeout_ms,
                           callback=callback, on_key=on_key)

    def exists_batch(self, keys: Sequence[Key], *, group: Any = None,
                     timeout_ms: int | None = None, callback: BatchCallback | None = None,
                     on_key: KeyCallback | None = None) -> list[bool]:
        """Synchronous ``exists_batch_async`` (same Args and Failure).

        Returns:
            True per key that is stored now; False for absent, timeout or dead server.
        """
        if len(keys) == 1 and callback is None and on_key is None:  # point.py
            return [point.call(self, Op.EXISTS, self._key(keys[0]), group,
                               self._deadline(timeout_ms))]
        fut = self._keyed(Op.EXISTS, keys, group=group, timeout_ms=timeout_ms,
                          callback=callback, on_key=on_key, here=True)
        return self._wait(fut, len(keys), False)

    def exists(self, key: Key, *, group: Any = None,
               timeout_ms: int | None = None, callback: BatchCallback | None = None,
               on_key: KeyCallback | None = None) -> bool:
        """Whether one key is stored now (the keywords as ``exists_batch_async``).

        Returns:
            True if stored; False for absent, timeout or dead server.

        Failure:
            Bad arguments raise ValueError.
        """
        return self.exists_batch([key], group=group, timeout_ms=timeout_ms,
                                 callback=callback, on_key=on_key)[0]

    def delete_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                           timeout_ms: int | None = None, callback: BatchCallback | None = None,
                           on_key: KeyCallback | None = None) -> Future[list[Status]]:
        """Delete keys.

        Args:
            keys, group, timeout_ms, callback, on_key: as ``put_batch_from_async``.

        Returns:
            A Future of ``list[Status]``: OK if the key was deleted, MISS if absent.

        Failure:
            Per-key statuses (TIMEOUT, UNAVAILABLE, AUTH, ...), never raised. Bad
            arguments raise ValueError.
        """
        return self._keyed(Op.DELETE, keys, group=group, timeout_ms=timeout_ms,
                           callback=callback, on_key=on_key)

    def delete_batch(self, keys: Sequence[Key], *, group: Any = None,
                     timeout_ms: int | None = None, callback: BatchCallback | None = None,
                     on_key: KeyCallback | None = None) -> list[Status]:
        """Synchronous ``delete_batch_async`` (same Args and Failure).

        Returns:
            OK per key that was deleted, MISS per key that was absent.
        """
        if len(keys) == 1 and callback is None and on_key is None:  # point.py
            return [point.call(self, Op.DELETE, self._key(keys[0]), group,
                               self._deadline(timeout_ms))]
        fut = self._keyed(Op.DELETE, keys, group=group, timeout_ms=timeout_ms,
                          callback=callback, on_key=on_key, here=True)
        return self._wait(fut, len(keys), Status.TIMEOUT)

    def delete(self, key: Key, *, group: Any = None,
               timeout_ms: int | None = None, callback: BatchCallback | None = None,
               on_key: KeyCallback | None = None) -> Status:
        """Delete one key (the keywords as ``delete_batch_async``).

        Returns:
            OK if deleted, MISS if absent, else a miss status.

        Failure:
            Bad arguments raise ValueError.
        """
        return self.delete_batch([key], group=group, timeout_ms=timeout_ms,
                                 callback=callback, on_key=on_key)[0]

    def touch_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                          timeout_ms: int | None = None, callback: BatchCallback | None = None,
                          on_key: KeyCallback | None = None) -> Future[list[Status]]:
        """Refresh recency (protect from eviction) without moving data.

        Args:
            keys, group, timeout_ms, callback, on_key: as ``put_batch_from_async``.

        Returns:
            A Future of ``list[Status]``: OK if the key is stored, MISS if absent.

        Failure:
            Per-key statuses, never raised. Bad arguments raise ValueError.
        """
        return self._keyed(Op.TOUCH, keys, group=group, timeout_ms=timeout_ms,
                           callback=callback, on_key=on_key)

    def touch_batch(self, keys: Sequence[Key], *, group: Any = None,
                    timeout_ms: int | None = None, callback: BatchCallback | None = None,
                    on_key: KeyCallback | None = None) -> list[Status]:
        """Synchronous ``touch_batch_async`` (same Args and Failure).

        Returns:
            ``list[Status]``, one per key.
        """
        if len(keys) == 1 and callback is None and on_key is None:  # point.py
            return [point.call(self, Op.TOUCH, self._key(keys[0]), group,
                               self._deadline(timeout_ms))]
        fut = self._keyed(Op.TOUCH, keys, group=group, timeout_ms=timeout_ms,
                          callback=callback, on_key=on_key, here=True)
        return self._wait(fut, len(keys), Status.TIMEOUT)

    def touch(self, key: Key, *, group: Any = None,
              timeout_ms: int | None = None, callback: BatchCallback | None = None,
              on_key: KeyCallback | None = None) -> Status:
        """Refresh one key's recency (the keywords as ``touch_batch_async``).

        Returns:
            OK if stored, MISS if absent, else a miss status.

        Failure:
            Bad arguments raise ValueError.
        """
        return self.touch_batch([key], group=group, timeout_ms=timeout_ms,
                                callback=callback, on_key=on_key)[0]

    # ------------------------------------------------------------------ admin
    def stats(self, timeout_ms: int = 2000) -> dict[str, dict]:
        """Per-server STATS, fetched directly (not through the dispatch queues), from
        every server at once.

        Args:
            timeout_ms: how long to wait for the answers.

        Returns:
            ``{address: stats}`` for every server this client has a lane to, within
            ``timeout_ms`` (plus scheduling noise).

        Failure:
            A server that did not answer in time maps to ``{"error": ...}``; never raises.
        """
        return self._dispatcher.stats(self._dispatcher.clock.monotonic() + timeout_ms / 1000)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Fail queued work with CLOSED and stop the background threads. Idempotent.

        Returns:
            None, once the dispatch threads stopped (or ``timeout_ms`` + 2 s passed).

        Failure:
            Never raises; every pending callback and future completes (CLOSED).
        """
        if self._closed:
            return
        self._closed = True
        self._router.close()
        self._dispatcher.close(self.timeout + 2)
        self._streams.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _keys(self, keys: Sequence[Key]) -> list[bytes]:
        """``[self._key(k) for k in keys]``: C-level passes only when every key already is
        non-empty ``bytes`` within ``max_key_bytes`` (content hashes, the usual batch)."""
        ks = list(keys)
        if ks and set(map(type, ks)) == {bytes} and min(map(len, ks)) > 0 \
                and max(map(len, ks)) <= self.limits.max_key_bytes:
            return ks
        return [self._key(k) for k in ks]

    def _key(self, key: Key) -> bytes:
        k = key if type(key) is bytes else key.encode() if isinstance(key, str) else bytes(key)
        if not k:
            raise ValueError("keys must be non-empty")
        if len(k) > self.limits.max_key_bytes:
            raise ValueError(f"key of {len(k)} bytes exceeds max_key_bytes "
                             f"{self.limits.max_key_bytes}")
        return k

    def _deadline(self, timeout_ms: int | None) -> float:
        now = self._dispatcher.clock.monotonic()  # deadlines are the dispatcher's clock's
        return now + (self.timeout if timeout_ms is None else timeout_ms / 1000.0)

    def _start(self, batch: Batch, group: Any, placement: list[int] | None = None,
               here: bool = False) -> Future | Batch:
        """Route ``batch``'s keys (by ``group``, or the checked hashes ``placement``) and
        send its items (CLOSED when closed): its future, or (``here``: a synchronous call,
        so a small one may run its IO on this thread, ``Router.send``, one-hop) the batch
        itself, for ``_wait``."""
        if self._metrics is not None:
            clock = self._dispatcher.clock.monotonic
            self._metrics.watch(batch, str(self.transport), clock(), clock)
        if self._closed:
            batch.fail_all(Status.CLOSED)
            return batch if here else batch.future
        if batch.keys:
            router = self._router
            batch.hashes = hashes = (router.hashes(batch.keys, group) if placement is None
                                     else placement)
            batch.handoff = router.handoff_for(batch)
            router.send(batch, batch.route(router.owners(hashes), self.slice), here=here)
        return batch if here else batch.future

    def _keyed(self, op: int, keys: Sequence[Key], *, group: Any = None,
               timeout_ms: int | None = None, callback: BatchCallback | None = None,
               on_key: KeyCallback | None = None, here: bool = False) -> Future | Batch:
        return self._start(KeyBatch(op, self._keys(keys),
                                    self._deadline(timeout_ms), self._router, callback,
                                    on_key), group, None, here)

    def _put_after_stream(self, keys: Sequence[Key], buffers: Sequence[Any], stream: Any,
                          group: Any, timeout_ms: int | None, callback: BatchCallback | None,
                          on_key: KeyCallback | None, if_absent: bool,
                          chain: bytes | None) -> Future:
        device = self._settings.device_buffers
        for b in buffers:  # argument errors raise now, not in the watcher thread
            as_view(b, writable=False, device=device)

        def start(left_ms: int) -> Future:
            return self.put_batch_from_async(keys, buffers, group=group, timeout_ms=left_ms,
                                             callback=callback, on_key=on_key,
                                             if_absent=if_absent, chain_parent=chain)

        def missed() -> list:
            res = [Status.TIMEOUT] * len(keys)
            for i, k in enumerate(keys):
                _safe(on_key, i, self._key(k), Status.TIMEOUT)
            _safe(callback, res)
            return res

        return self._streams.start_after(stream, self._deadline(timeout_ms), start, missed)

    def _dial(self, address: str) -> TcpTransport:
        """A plain connection to ``address`` (probes, STATS)."""
        s = self._settings
        return TcpTransport(address, s.token, s.limits, s.connect_timeout_s, s.tls)

    def _wait(self, fut: Future | Batch, n: int, fallback: Any) -> list:
        """A synchronous call's results: at once when its batch completed on this thread
        (one-hop; no Future made), else its future's, bounded."""
        if isinstance(fut, Batch):
            if fut.done:
                return fut.results
            fut = fut.future
        try:
            return fut.result(timeout=self.timeout * 4 + 5.0)
        except TimeoutError:  # defensive: the reaper should have completed it
            log.error("batch outlived its deadline by seconds; reporting TIMEOUT")
            return [fallback] * n


def _safe(fn: Callable | None, *args: Any) -> None:
    if fn is None:
        return
    try:
        fn(*args)
    except Exception:
        log.exception("callback raised")


def _first(fut: Future) -> Future:
    out: Future = Future()
    fut.add_done_callback(lambda f: out.set_result(f.result()[0]))
    return out


def _placement(placement: Sequence[int], n: int, group: Any) -> list[int]:
    """``placement=`` checked: one u64 per key, and no ``group`` beside it (ValueError)."""
    if group is not None:
        raise ValueError("give placement= or group=, not both")
    ph = list(placement)
    if len(ph) != n or (n and (not set(map(type, ph)) <= {int} or min(ph) < 0
                               or max(ph) >= 1 << 64)):
        raise ValueError("placement= must hold one u64 placement hash per key")
    return ph
