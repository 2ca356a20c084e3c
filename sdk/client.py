"""gcache SDK client: put/get/exists/delete/touch, batch, zero-copy and async forms.

Design. The user thread validates arguments, routes each key to its owner on
the consistent-hash ring, slices values larger than ``slice_bytes`` into
pieces, packs pieces into frames (about ``frame_target_bytes`` each, spread
over the owner's connections) and enqueues them on the owner's ``Lane``. It
never does IO. Dispatch threads run the frames; their completions are folded
per key (all slices) and per batch, and each key callback and each batch
callback/future fires exactly once — on success, miss, timeout, peer death or
close alike.

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
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Sequence

from gcache.config import TRANSPORTS, load_config
from gcache.credentials import ClientCredential, bearer_of, parse_client_credential
from gcache.discovery import MasterClient
from gcache.errors import ConfigError
from gcache.protocol import Limits, Op
from gcache.status import Status
from gcache.tls import dialer_context
from gcache.view import View
from gcache.sdk.batch import (Batch, BatchCallback, BytesBatch, Checksums, IntoBatch,
                              KeyBatch, KeyCallback, PutBatch)
from gcache.sdk.buffers import as_view
from gcache.sdk.dispatcher import Dispatcher
from gcache.sdk.routing import Router
from gcache.sdk.transports.base import Framing
from gcache.sdk.transports.factory import make_transport, nixl_usable
from gcache.sdk.transports.tcp import TcpTransport

if TYPE_CHECKING:
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
                 tls_cert_file: str | None = None, tls_key_file: str | None = None) -> None:
        if isinstance(servers, str):
            servers = servers.split(",")
        if isinstance(masters, str):
            masters = masters.split(",")
        if not servers and not masters:
            raise ConfigError("Client needs masters=[host:port, ...] or servers=[host:port, ...]")
        cfg = load_config("client", config_file, cli={
            "timeout_ms": timeout_ms, "token": token, "credential": credential,
            "slice_bytes": slice_bytes,
            "conns_per_server": conns_per_server, "queue_depth": queue_depth,
            "frame_target_bytes": frame_target_bytes, "probe_interval_ms": probe_interval_ms,
            "connect_timeout_ms": connect_timeout_ms, "transport": transport,
            "nixl_bounce_bytes": nixl_bounce_bytes, "verify_checksums": verify_checksums,
            "tls": tls if tls is None or isinstance(tls, bool) else True,
            "tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file,
            "tls_key_file": tls_key_file})
        self.config = cfg
        # the dialer context of every data connection and master call (None = plain)
        self._tls = tls if isinstance(tls, ssl.SSLContext) else dialer_context(cfg)
        self.namespace = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
        self.limits = limits or Limits()
        if len(self.namespace) > self.limits.max_namespace_bytes:
            raise ConfigError(f"namespace longer than {self.limits.max_namespace_bytes} bytes")
        self.timeout = cfg.timeout_ms / 1000.0
        self.slice = int(cfg.slice_bytes)
        self.frame_target = int(cfg.frame_target_bytes)
        self.conns = int(cfg.conns_per_server)
        self._checks = Checksums(bool(cfg.verify_checksums))
        self.counters = self._checks.counters  # reads refused by verify_checksums
        # what AUTH proves: the credential when set, else the legacy token ('' = none)
        self._token: str | ClientCredential = (parse_client_credential(cfg.credential)
                                               if cfg.credential else cfg.token)
        self.transport = str(getattr(cfg, "transport", "auto") or "auto")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, "
                              f"not {self.transport!r}")
        if self._tls is not None and self.transport == "nixl":
            raise ConfigError("transport='nixl' cannot run under TLS: its bytes move by "
                              "RDMA outside the TLS channel; use transport tcp, shm or auto "
                              "with TLS, or turn TLS off on a trusted fabric")
        self._device_ok = self.transport == "nixl"  # CUDA buffers need one-sided transfers
        # nixl is in play: asked for, or auto on a host with an RDMA device and the library
        # (never under TLS)
        self._nixl = self.transport == "nixl" or (self.transport == "auto" and nixl_usable()
                                                  and self._tls is None)
        if self._nixl:
            # the agent takes ~0.4 s to start: here, not inside the first op's deadline
            from gcache.nixl_lib import NixlUnavailable
            from gcache.sdk.transports.nixl import process_agent

            try:
                process_agent()
            except NixlUnavailable as exc:
                if self.transport == "nixl":
                    raise ConfigError(f"transport='nixl': {exc}") from None
        self._watcher: Any = None  # StreamWatcher, made on the first stream= call
        self._event_factory: Any = None  # None = torch.cuda.Event (tests may replace it)
        self._state_lock = threading.Lock()
        self._closed = False
        connect_s = cfg.connect_timeout_ms / 1000.0
        self._framing = Framing(self.slice, self.frame_target, self.conns,
                                self.limits.max_batch_items)
        self._dispatcher = Dispatcher(
            lambda address: make_transport(
                self.transport, address, self._token, self.limits, connect_s,
                int(cfg.nixl_bounce_bytes), int(cfg.one_sided_min_bytes), self._tls),
            self._dial, conns=self.conns, queue_depth=cfg.queue_depth,
            probe_interval=cfg.probe_interval_ms / 1000.0, connect_timeout=connect_s)
        master = None
        if masters:
            master = MasterClient(masters, bearer_of(self._token),
                                  timeout_s=max(0.5, cfg.connect_timeout_ms / 1000.0),
                                  tls=self._tls)
        self._router = Router(self.namespace, list(servers or []), master, self._dispatcher,
                              self._framing)
        self._router.start()

    # ------------------------------------------------------------------ registration
    def register_buffer(self, buf: Any) -> bool:
        """Register ``buf`` (host memory, or a CUDA tensor) for zero-copy nixl transfers.

        Gets into and puts from registered memory move by one-sided READ/WRITE with no
        copy on this host (GPUDirect for CUDA memory where the NIC supports it);
        anything else goes through a per-connection bounce buffer. Returns False (and
        does nothing) when this client does not use nixl. Register long-lived pools
        (KV host/device buffers), not per-request buffers: registration pins memory.
        """
        if not self._nixl:
            return False
        from gcache.nixl_lib import NixlUnavailable
        from gcache.sdk.transports.nixl import REGISTRY

        try:
            return REGISTRY.add(buf)
        except NixlUnavailable as exc:
            raise ConfigError(str(exc)) from None

    def unregister_buffer(self, buf: Any) -> bool:
        """Undo ``register_buffer``; no transfer may be using ``buf``."""
        if not self._nixl:
            return False
        from gcache.sdk.transports.nixl import REGISTRY

        return REGISTRY.remove(buf)

    # ------------------------------------------------------------------ plumbing
    def _dial(self, address: str) -> TcpTransport:
        """A plain connection to ``address`` (probes, STATS)."""
        return TcpTransport(address, self._token, self.limits,
                            self.config.connect_timeout_ms / 1000.0, self._tls)

    def update_view(self, view: View) -> None:
        """Route by a new membership view (normally fed by the masters)."""
        self._router.update(view)

    @property
    def view(self) -> View:
        return self._router.view

    def _key(self, key: Key) -> bytes:
        k = key if type(key) is bytes else key.encode() if isinstance(key, str) else bytes(key)
        if not k:
            raise ValueError("keys must be non-empty")
        if len(k) > self.limits.max_key_bytes:
            raise ValueError(f"key of {len(k)} bytes exceeds max_key_bytes "
                             f"{self.limits.max_key_bytes}")
        return k

    def owners(self, keys: Sequence[Key], group: Any = None) -> list[str]:
        """The server address each key routes to in the current view ('' = none)."""
        router = self._router
        return router.owners(router.hashes([self._key(k) for k in keys], group))

    def _start(self, batch: Batch, group: Any) -> Future:
        """Route ``batch``'s keys and send its items (CLOSED when closed): its future."""
        if self._closed:
            return batch.fail_all(Status.CLOSED).future
        if batch.keys:
            router = self._router
            batch.hashes = hashes = router.hashes(batch.keys, group)
            router.send(batch, batch.route(router.owners(hashes), self.slice))
        return batch.future

    def _deadline(self, timeout_ms: int | None) -> float:
        return time.monotonic() + (self.timeout if timeout_ms is None else timeout_ms / 1000.0)

    # ------------------------------------------------------------------ puts
    def put_batch_from_async(self, keys: Sequence[Key], buffers: Sequence[Any], *,
                             group: Any = None, timeout_ms: int | None = None,
                             callback: BatchCallback | None = None,
                             on_key: KeyCallback | None = None, stream: Any = None) -> Future:
        """Store ``buffers[i]`` under ``keys[i]``, reading the buffers in place.

        Returns a Future of ``list[Status]``. The buffers must stay unchanged until
        the future completes. Failure: per-key statuses (TOO_LARGE, NO_SPACE,
        TIMEOUT, UNAVAILABLE, ...); never raises for runtime faults.
        ``stream`` (a torch.cuda.Stream): start only once the stream has reached this
        call, so the caller need not synchronize the work that fills the buffers.
        """
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers differ in length")
        if stream is not None:
            return self._put_after_stream(keys, buffers, stream, group=group,
                                          timeout_ms=timeout_ms, callback=callback,
                                          on_key=on_key)
        ks = [self._key(k) for k in keys]
        views = [as_view(b, writable=False, device=self._device_ok) for b in buffers]
        batch = PutBatch(ks, views, self.limits, self._deadline(timeout_ms), self._router,
                         callback, on_key)
        return self._start(batch, group)

    def _put_after_stream(self, keys: Sequence[Key], buffers: Sequence[Any], stream: Any, *,
                          timeout_ms: int | None, callback: BatchCallback | None,
                          on_key: KeyCallback | None, **kw: Any) -> Future:
        for b in buffers:  # argument errors raise now, not in the watcher thread
            as_view(b, writable=False, device=self._device_ok)
        outer: Future = Future()
        deadline = self._deadline(timeout_ms)

        def submit(reached: bool) -> None:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if not reached or left_ms < 1:  # the stream never got there in time
                res = [Status.TIMEOUT] * len(keys)
                for i, k in enumerate(keys):
                    _safe(on_key, i, self._key(k), Status.TIMEOUT)
                _safe(callback, res)
                outer.set_result(res)
                return
            inner = self.put_batch_from_async(keys, buffers, timeout_ms=left_ms,
                                              callback=callback, on_key=on_key, **kw)
            inner.add_done_callback(lambda f: outer.set_result(f.result()))

        self._streams().after(stream, submit, deadline)
        return outer

    def _streams(self) -> Any:
        from gcache.sdk.cuda_events import StreamWatcher, cuda_event_factory

        with self._state_lock:
            if self._watcher is None:
                # raises ValueError here, in the caller, when CUDA is not available
                self._watcher = StreamWatcher(self._event_factory or cuda_event_factory())
            return self._watcher

    def _after_stream(self, stream: Any, callback: BatchCallback | None, timeout_ms: int | None
                      ) -> tuple[BatchCallback, Future]:
        """A batch callback that defers ``callback`` and the returned future until
        ``stream`` passes the point where the batch completed."""
        outer: Future = Future()
        watcher = self._streams()
        deadline = self._deadline(timeout_ms) + 1.0

        def on_batch(results: list) -> None:
            res = list(results)

            def fire(_reached: bool) -> None:
                _safe(callback, res)
                outer.set_result(res)

            watcher.after(stream, fire, deadline)

        return on_batch, outer

    def put_batch_from(self, keys: Sequence[Key], buffers: Sequence[Any], **kw: Any
                       ) -> list[Status]:
        """Synchronous ``put_batch_from_async``: returns ``list[Status]``."""
        return self._wait(self.put_batch_from_async(keys, buffers, **kw), len(keys), Status.TIMEOUT)

    def put_batch(self, keys: Sequence[Key], values: Sequence[bytes], **kw: Any) -> list[Status]:
        """Store byte values. Returns one Status per key."""
        return self.put_batch_from(keys, values, **kw)

    def put_batch_async(self, keys: Sequence[Key], values: Sequence[bytes], **kw: Any) -> Future:
        return self.put_batch_from_async(keys, values, **kw)

    def put(self, key: Key, value: Any, **kw: Any) -> Status:
        """Store one value (bytes or any buffer). Returns its Status."""
        return self.put_batch_from([key], [value], **kw)[0]

    def put_async(self, key: Key, value: Any, **kw: Any) -> Future:
        return _first(self.put_batch_from_async([key], [value], **kw))

    # ------------------------------------------------------------------ gets
    def get_batch_into_async(self, keys: Sequence[Key], buffers: Sequence[Any], *,
                             group: Any = None, timeout_ms: int | None = None,
                             callback: BatchCallback | None = None,
                             on_key: KeyCallback | None = None, stream: Any = None) -> Future:
        """Read each object straight into ``buffers[i]`` (exact size expected).

        Returns a Future of ``list[Status]``: OK, MISS, SIZE_MISMATCH (the object
        is not ``len(buffer)`` bytes), TIMEOUT, UNAVAILABLE, CONFLICT... A buffer
        whose key is not OK may hold partial bytes. ``stream`` (a torch.cuda.Stream):
        the batch callback and the future complete once the stream has passed the
        point where every key landed (per-key callbacks still fire per key).
        """
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers differ in length")
        outer = None
        if stream is not None:
            callback, outer = self._after_stream(stream, callback, timeout_ms)
        ks = [self._key(k) for k in keys]
        views = [as_view(b, writable=True, device=self._device_ok) for b in buffers]
        batch = IntoBatch(ks, views, self._checks, self._deadline(timeout_ms), self._router,
                          callback, on_key)
        fut = self._start(batch, group)
        return fut if outer is None else outer

    def get_batch_into(self, keys: Sequence[Key], buffers: Sequence[Any], **kw: Any
                       ) -> list[Status]:
        """Synchronous ``get_batch_into_async``."""
        return self._wait(self.get_batch_into_async(keys, buffers, **kw), len(keys), Status.TIMEOUT)

    def get_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                        timeout_ms: int | None = None, callback: BatchCallback | None = None,
                        on_key: KeyCallback | None = None) -> Future:
        """Future of ``list[bytes | None]``; ``None`` is a miss (absent, timeout, dead server)."""
        batch = BytesBatch([self._key(k) for k in keys], self._checks,
                           self._deadline(timeout_ms), self._router, callback, on_key)
        return self._start(batch, group)

    def get_batch(self, keys: Sequence[Key], **kw: Any) -> list[bytes | None]:
        """Read values as bytes; ``None`` for every kind of miss."""
        return self._wait(self.get_batch_async(keys, **kw), len(keys), None)

    def get(self, key: Key, **kw: Any) -> bytes | None:
        """Read one value; ``None`` on a miss, a timeout or a dead server."""
        return self.get_batch([key], **kw)[0]

    def get_async(self, key: Key, **kw: Any) -> Future:
        return _first(self.get_batch_async([key], **kw))

    # ------------------------------------------------------------------ keyed ops
    def _keyed_async(self, op: int, keys: Sequence[Key], group: Any, timeout_ms: int | None,
                     callback: BatchCallback | None, on_key: KeyCallback | None) -> Future:
        batch = KeyBatch(op, [self._key(k) for k in keys], self._deadline(timeout_ms),
                         self._router, callback, on_key)
        return self._start(batch, group)

    def exists_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                           timeout_ms: int | None = None, callback: BatchCallback | None = None,
                           on_key: KeyCallback | None = None) -> Future:
        return self._keyed_async(Op.EXISTS, keys, group, timeout_ms, callback, on_key)

    def exists_batch(self, keys: Sequence[Key], **kw: Any) -> list[bool]:
        """True per key that is stored now; False for absent, timeout or dead server."""
        return self._wait(self.exists_batch_async(keys, **kw), len(keys), False)

    def exists(self, key: Key, **kw: Any) -> bool:
        return self.exists_batch([key], **kw)[0]

    def delete_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                           timeout_ms: int | None = None, callback: BatchCallback | None = None,
                           on_key: KeyCallback | None = None) -> Future:
        return self._keyed_async(Op.DELETE, keys, group, timeout_ms, callback, on_key)

    def delete_batch(self, keys: Sequence[Key], **kw: Any) -> list[Status]:
        """OK if the key was deleted, MISS if it was absent."""
        return self._wait(self.delete_batch_async(keys, **kw), len(keys), Status.TIMEOUT)

    def delete(self, key: Key, **kw: Any) -> Status:
        return self.delete_batch([key], **kw)[0]

    def touch_batch_async(self, keys: Sequence[Key], *, group: Any = None,
                          timeout_ms: int | None = None, callback: BatchCallback | None = None,
                          on_key: KeyCallback | None = None) -> Future:
        return self._keyed_async(Op.TOUCH, keys, group, timeout_ms, callback, on_key)

    def touch_batch(self, keys: Sequence[Key], **kw: Any) -> list[Status]:
        """Refresh recency (protect from eviction) without moving data."""
        return self._wait(self.touch_batch_async(keys, **kw), len(keys), Status.TIMEOUT)

    def touch(self, key: Key, **kw: Any) -> Status:
        return self.touch_batch([key], **kw)[0]

    def stats(self, timeout_ms: int = 2000) -> dict[str, dict]:
        """Per-server STATS, fetched directly (not through the dispatch queues), from
        every server at once. Returns within ``timeout_ms`` (plus scheduling noise); a
        server that did not answer in time maps to ``{"error": ...}``."""
        deadline = time.monotonic() + timeout_ms / 1000
        addrs = self._dispatcher.addresses()
        out: dict[str, dict] = {}

        def one(addr: str) -> None:
            t = self._dial(addr)
            try:
                t.connect(deadline)
                out[addr] = t.call_stats(deadline)
            except Exception as exc:
                out[addr] = {"error": str(exc) or type(exc).__name__}
            finally:
                t.close()

        threads = [threading.Thread(target=one, args=(a,), name=f"gcache-stats-{a}",
                                    daemon=True) for a in addrs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 0.5)
        return {a: out.get(a, {"error": "timed out"}) for a in addrs}

    # ------------------------------------------------------------------ lifecycle
    def _wait(self, fut: Future, n: int, fallback: Any) -> list:
        try:
            return fut.result(timeout=self.timeout * 4 + 5.0)
        except TimeoutError:  # defensive: the reaper should have completed it
            log.error("batch outlived its deadline by seconds; reporting TIMEOUT")
            return [fallback] * n

    def close(self) -> None:
        """Fail queued work with CLOSED, stop dispatch threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._router.close()
        self._dispatcher.close(self.timeout + 2)
        if self._watcher is not None:
            self._watcher.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
