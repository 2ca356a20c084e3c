/* gcache._native: the per-key hot loops of the shm data path, in C.
 *
 * Design. Each function here has a pure-Python twin in gcache/native.py (same
 * arguments, same results, same exception types), and tests/core/test_native_*.py
 * check the two against each other with hypothesis. gcache/native.py picks this
 * module when it imports and GCACHE_NATIVE is not 0; otherwise the twins run.
 *
 *   copy_spans(spans, base, size, into, stop_at) -> list[int | None]
 *       Copy N spans between caller buffers and one mapped region [base, base+size)
 *       (the shm arena, read-only, or a staging file) in ONE call, the GIL released
 *       for the whole loop so dispatch threads copy in parallel. A span is a tuple
 *       (buffer, offset, n, want_hash): into=True copies n bytes from base+offset into
 *       the buffer's first n bytes; into=False copies the buffer's first n bytes to
 *       base+offset. With want_hash the buffer's n bytes are hashed (xxh3_64, seed 0)
 *       right after each chunk of them moved, while they are still in the cache: the
 *       bytes that landed (into=True: a get's checksum check) or the bytes that were
 *       sent (into=False: a staged put's checksum, computed in the same pass as its
 *       copy; a buffer changed mid-copy then hashes unlike the copy, which the server
 *       refuses). Either costs a fraction of a second pass over DRAM. On x86-64 a
 *       span of 32 KiB or more is streamed: non-temporal stores (no read of the
 *       destination's lines first, none left in the caches: a third less DRAM traffic),
 *       each 16 KiB chunk hashed from the source just before it is copied from those
 *       same cached lines, so the digest is still of the bytes that moved; one sfence
 *       ends the call. Returns each span's digest, or None where want_hash was false.
 *       Bounds: every span is checked before the first byte moves (0 <= offset,
 *       offset + n <= size, 0 <= n <= len(buffer); a read-only buffer cannot be a
 *       destination): ValueError, TypeError for a non-buffer or a non-int. Deadline:
 *       the clock (CLOCK_MONOTONIC, = time.monotonic) is read before the first span
 *       and again at the first span boundary after every CHECK_BYTES copied; at or
 *       past stop_at the call raises TimeoutError (spans before it have landed).
 *
 *   pread_spans(fd, spans) -> (list[int | None], list[int])
 *       Fill N caller buffers from file descriptor fd (a file a peer may shrink: a read
 *       past its end is a short span, never a fault) in ONE call, the GIL released for
 *       the whole loop. A span is a tuple (buffer, file_offset, want_hash): all
 *       len(buffer) bytes are read from file_offset on (pread, retried on EINTR and
 *       after a short read). With want_hash the buffer is hashed (xxh3_64, seed 0)
 *       chunk by chunk right after each chunk landed. Returns
 *       (digests, short): each span's digest, or None where want_hash was false or the
 *       file ended first; and the indices of the spans the file ended before filling
 *       (their buffers hold what was there). Bounds: every span is checked before the
 *       first read (a writable C-contiguous buffer, else TypeError / ValueError; an int
 *       offset >= 0, else TypeError / ValueError). A read error other than EINTR stops
 *       the loop at that span and raises OSError with its errno (spans before it have
 *       landed).
 *
 *   read_staged(fd, mapping, spans) -> (list[int | None], list[int])
 *       pread_spans, where mapping (None, or a read-only mapping of fd's first
 *       len(mapping) bytes: a client's staging file) serves each span inside it by
 *       memcpy instead of pread: from tmpfs a pread costs 2.7-2.9x the memcpy (the
 *       kernel looks up each 4 KiB page). The client may shrink its file under the copy,
 *       which faults (SIGBUS): the fault guard (above map_span) turns that into a short
 *       span, as pread_spans reports a file that ended; the process never dies of it.
 *       (Between the new end and its page's end a mapping reads zeros where pread
 *       stops: such a span is not short, and its digest is of those zeros.)
 *
 *   pread_records(spans) -> (list[int | None], list[tuple[int, int]])
 *       The disk tier's batched read: fill N caller buffers, each from its own file
 *       descriptor (a segment file, maybe O_DIRECT: the caller's buffers and lengths
 *       are block-aligned) in ONE call, the GIL released for the whole loop, so an IO
 *       thread issues a group of reads and checksums them without a hand-off per
 *       item. A span is a tuple (fd, buffer, file_offset, hash_from, hash_to): all
 *       len(buffer) bytes are read from file_offset on (pread, retried on EINTR and
 *       after a short read), then buffer[hash_from:hash_to] is hashed (xxh3_64, seed
 *       0: a record's data behind its header). A failed span does not stop the
 *       others. Returns (digests, failed): each span's digest, or None where its read
 *       failed; and (index, errno) for each failed span, errno 0 where the file ended
 *       before the buffer filled. Bounds: every span is checked before the first read
 *       (an int fd that fits a C int, else TypeError / ValueError; a writable
 *       C-contiguous buffer; an int offset >= 0; ints 0 <= hash_from <= hash_to <=
 *       len(buffer)): TypeError / ValueError.
 *
 *   checksums(buffers) -> list[int]
 *       xxh3_64 (seed 0) of each buffer's bytes, in ONE call with the GIL released for
 *       all of them: the value checksums a TCP put's server computes for the items a
 *       frame carried whole, right after they landed, and a client for the values it
 *       sends, without holding the GIL (other connection or dispatch threads run
 *       Python meanwhile). Every buffer is exported before the first byte is hashed:
 *       TypeError for an object without the buffer protocol, ValueError for one that
 *       is not C-contiguous.
 *
 *   recv_views(sock, views, want, stop_at) -> list[int | None]
 *       Fill every caller buffer in views, in order, from the stream socket sock (a
 *       socket object, or anything with fileno(); never a TLS socket: its fd carries
 *       ciphertext) in ONE call, the GIL released for the whole loop: scatter reads
 *       (recvmsg, MSG_DONTWAIT, up to RECV_IOV buffers a call) and, when one would
 *       block, poll for the rest of the time to stop_at. want (None, or one flag per
 *       view): each flagged view's bytes are hashed (xxh3_64, seed 0) right after
 *       each read that filled some of them (a read is capped at RECV_HASH_BYTES then,
 *       so they are still in the cache): a TCP get's checksum check without a second
 *       pass over DRAM and without the GIL (with it, hashing under the GIL was a
 *       sixth of a 1 MiB get's time on four connections). Returns each view's digest,
 *       or None where not flagged (an empty flagged view: the digest of no bytes).
 *       The socket's own blocking mode and timeout do not matter. The clock
 *       (CLOCK_MONOTONIC) is read before every read: at or past stop_at,
 *       TimeoutError (socket.timeout), so nothing starts after the deadline and a
 *       peer that trickles bytes cannot stretch it. EOF before the last byte:
 *       ConnectionError. A read error: OSError with its errno. EINTR: the signal
 *       handlers run (an exception they raise propagates), then the read is retried.
 *       Views before the failure hold what landed; the stream's position is then
 *       unknown and the caller closes it. Bounds: every view is exported before the
 *       first read (a writable C-contiguous buffer, else TypeError / ValueError), want
 *       has one flag per view (ValueError), sock has a file descriptor (TypeError /
 *       ValueError), stop_at is a number (NaN: ValueError). The descriptor is read once: no other thread may close sock during
 *       the call (the SDK's transports are closed only by the thread that reads them).
 *
 *   exchange(sock, request, view, at_least, stop_at) -> int
 *       A one-item call's round trip on a plain stream socket (never TLS) in ONE call,
 *       the GIL released for all of it: send every byte of request (send,
 *       MSG_DONTWAIT | MSG_NOSIGNAL), then receive into view (recv, MSG_DONTWAIT; reads
 *       of up to the view's free room) until at least at_least bytes landed; returns
 *       the bytes received (at_least..len(view)). The caller parses them (a reply's
 *       prefix, header and as much of its payload as came) and reads any rest itself.
 *       A call that would block polls for the time left to stop_at; the clock is read
 *       before every send and read: at or past stop_at, TimeoutError. EOF before
 *       at_least bytes: ConnectionError. A send or read error: OSError with its errno
 *       (EPIPE, not SIGPIPE). EINTR: the signal handlers run, then the call is retried.
 *       After an exception the stream's position is unknown and the caller closes it.
 *       Bounds: request is a buffer, view a writable C-contiguous buffer (TypeError /
 *       ValueError), 1 <= at_least <= len(view) (ValueError), stop_at a number (NaN:
 *       ValueError); the descriptor is read once, as recv_views.
 *
 *   byte_views(objs, writable) -> list[memoryview]
 *       sdk/buffers.py's as_view for host buffers, a batch per call: each object's
 *       memoryview, cast to flat unsigned bytes when it is not already; ValueError for
 *       a non-contiguous buffer or (writable) a read-only one, TypeError for an object
 *       without the buffer protocol (a torch tensor: the caller then takes as_view).
 *
 *   placement_hashes(namespace, keys, seed) -> list[int]
 *       xxh3_64(namespace + b"\0" + key, seed) for each key (bytes only: TypeError),
 *       without building the concatenation as a Python object.
 *
 *   header_write(buf, off, ns, key, version, length, created_ns, ph, mark_at) -> int
 *   header_commit(buf, off, csum) -> None
 *       The arena's chunk header (server/arena.py's layout), written in place in the
 *       writable buffer buf (the arena's mapping): header_write stores an uncommitted
 *       header at off (the fixed 64 bytes, the namespace, the key and, when ph is not
 *       None, the 8-byte placement hash with FLAG_PLACED), then buf[mark_at] = 1 (the
 *       chunk's start mark, after the header), and returns the data offset (off plus
 *       the header rounded up to 64 bytes); header_commit stores the value checksum,
 *       then the header's CRC32 (zlib's polynomial, over bytes 8-48 and the namespace,
 *       key and placement hash), then, last, FLAG_COMMITTED. One put's worth each, with
 *       the GIL held (a few hundred bytes): they replace struct.pack_into calls and
 *       slices that cost ~2.7 us a header. Every argument is converted and checked
 *       before a byte is written, in argument order: TypeError for a non-buffer, a
 *       non-int, a namespace or key that is not bytes; OverflowError for a negative or
 *       over-64-bit value or an offset past a ssize_t; ValueError for a read-only or
 *       non-contiguous buffer, a namespace or key over 65535 bytes, or a header or mark
 *       outside the buffer.
 *
 * Threads: any. copy_spans, pread_spans, read_staged, pread_records, recv_views and
 * checksums hold every buffer export (Py_buffer) for the whole call, so no buffer can be
 * resized or freed under the copy or the read. Nothing here keeps state between calls but
 * read_staged's SIGBUS handler, installed only while some thread copies from a
 * mapping (see the fault guard).
 *
 * xxHash (BSD-2, native/third_party/xxhash) is compiled in; its x86 dispatcher picks
 * the widest vector unit at run time, as the xxhash Python package does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <limits.h>
#include <unistd.h>
#include <signal.h>
#include <setjmp.h>
#include <pthread.h>
#include <math.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t; the functions come from xxhash.c */
#include "xxhash.h"
#if defined(__x86_64__) || defined(_M_X64)
#include "xxh_x86dispatch.h"
#define GC_XXH3(p, n) XXH3_64bits_dispatch((p), (n))
#define GC_XXH3_SEED(p, n, s) XXH3_64bits_withSeed_dispatch((p), (n), (s))
#define GC_XXH3_UPDATE(st, p, n) XXH3_64bits_update_dispatch((st), (p), (n))
#else
#define GC_XXH3(p, n) XXH3_64bits((p), (n))
#define GC_XXH3_SEED(p, n, s) XXH3_64bits_withSeed((p), (n), (s))
#define GC_XXH3_UPDATE(st, p, n) XXH3_64bits_update((st), (p), (n))
#endif

#define CHECK_BYTES ((Py_ssize_t)2 << 20) /* read the clock at least this often */
#define HASH_CHUNK ((Py_ssize_t)64 << 10) /* copy, then hash, this much at a time */

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ``obj`` as a fast sequence (a new reference; NULL with TypeError(msg) otherwise), its
 * length and items in *count and *items */
static PyObject *fast_items(PyObject *obj, const char *msg, Py_ssize_t *count,
                            PyObject ***items) {
    PyObject *seq = PySequence_Fast(obj, msg);
    if (seq != NULL) {
        *count = PySequence_Fast_GET_SIZE(seq);
        *items = PySequence_Fast_ITEMS(seq);
    }
    return seq;
}

/* zeroed arrays of count spans of span_size bytes and count buffer exports (at least
 * one each, so a zero count is not a failure); 0, or -1 with MemoryError */
static int alloc_spans(Py_ssize_t count, size_t span_size, void **spans, Py_buffer **views) {
    size_t k = count ? (size_t)count : 1;
    *spans = PyMem_Calloc(k, span_size);
    *views = PyMem_Calloc(k, sizeof(Py_buffer));
    if (*spans == NULL || *views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* export span i's buffer (C-contiguous; writable when a destination): 0, or -1 with
 * TypeError / ValueError naming fn and the span, and nothing held */
static int take_buffer(PyObject *obj, Py_buffer *view, const char *fn, Py_ssize_t i,
                       int dest) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: span %zd's buffer is not a C-contiguous buffer",
                     fn, i);
        return -1;
    }
    if (dest && view->readonly) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: span %zd's destination is read-only", fn, i);
        return -1;
    }
    return 0;
}

typedef struct {
    char *local;   /* the caller buffer's first byte */
    Py_ssize_t off;
    Py_ssize_t n;
    int want_hash;
    XXH64_hash_t digest;
} span_t;

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define GC_STREAMING 1
#define STREAM_MIN ((Py_ssize_t)32 << 10)   /* spans this large bypass the caches */
#define STREAM_CHUNK ((Py_ssize_t)16 << 10) /* hash, then stream, this much at a time */

/* copy n bytes with non-temporal stores (SSE2: every x86-64 CPU): the destination's
 * lines are neither read first (no read-for-ownership) nor left in the caches, a third
 * less DRAM traffic than memcpy for a copy far larger than the caches will hold; plain
 * copies for the head up to 16-byte alignment and for the tail. The caller fences
 * (_mm_sfence) before anything else may read the bytes. */
static void stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}
#endif

/* copy one span (into: mapping -> buffer), hashing the caller buffer's bytes (what
 * landed, or what was sent) right after each chunk moved, when asked. A span of at
 * least STREAM_MIN bytes (x86-64) is streamed instead: each chunk is hashed from the
 * source, then copied from the cache lines just hashed with non-temporal stores, so
 * the digest is of the bytes that were copied (a copy out of the arena reads a leased
 * object no one writes; a staged put's source is the caller's buffer, as before). */
static void move_span(span_t *s, char *base, int into, XXH3_state_t *state) {
    char *dst = into ? s->local : base + s->off;
    const char *src = into ? base + s->off : s->local;
#ifdef GC_STREAMING
    if (s->n >= STREAM_MIN) {
        if (!s->want_hash) {
            stream_copy(dst, src, (size_t)s->n);
            return;
        }
        XXH3_64bits_reset(state);
        for (Py_ssize_t done = 0; done < s->n; done += STREAM_CHUNK) {
            Py_ssize_t k = s->n - done < STREAM_CHUNK ? s->n - done : STREAM_CHUNK;
            GC_XXH3_UPDATE(state, src + done, (size_t)k);
            stream_copy(dst + done, src + done, (size_t)k);
        }
        s->digest = XXH3_64bits_digest(state);
        return;
    }
#endif
    if (!s->want_hash) {
        if (s->n)
            memcpy(dst, src, (size_t)s->n);
        return;
    }
    if (s->n <= HASH_CHUNK) {
        if (s->n)
            memcpy(dst, src, (size_t)s->n);
        s->digest = GC_XXH3(s->local, (size_t)s->n);
        return;
    }
    XXH3_64bits_reset(state);
    for (Py_ssize_t done = 0; done < s->n; done += HASH_CHUNK) {
        Py_ssize_t k = s->n - done < HASH_CHUNK ? s->n - done : HASH_CHUNK;
        memcpy(dst + done, src + done, (size_t)k);
        GC_XXH3_UPDATE(state, s->local + done, (size_t)k);
    }
    s->digest = XXH3_64bits_digest(state);
}

static PyObject *copy_spans(PyObject *self, PyObject *args) {
    PyObject *spans_obj;
    unsigned long long base_addr;
    Py_ssize_t size;
    int into;
    double stop_at;
    if (!PyArg_ParseTuple(args, "OKnpd:copy_spans", &spans_obj, &base_addr, &size, &into,
                          &stop_at))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_spans: negative region size");
        return NULL;
    }
    Py_ssize_t count;
    PyObject **items;
    PyObject *seq = fast_items(spans_obj, "copy_spans: spans must be a sequence", &count,
                               &items);
    if (seq == NULL)
        return NULL;
    span_t *spans = NULL;
    Py_buffer *views = NULL;
    PyObject *out = NULL;
    Py_ssize_t held = 0;
    XXH3_state_t *state = NULL;
    if (alloc_spans(count, sizeof(span_t), (void **)&spans, &views) < 0)
        goto done;
    /* validate every span and take every buffer before the first byte moves */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = items[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
            PyErr_SetString(PyExc_TypeError,
                            "copy_spans: a span is a tuple (buffer, offset, n, want_hash)");
            goto done;
        }
        PyObject *o_off = PyTuple_GET_ITEM(t, 1), *o_n = PyTuple_GET_ITEM(t, 2);
        if (!PyLong_Check(o_off) || !PyLong_Check(o_n)) {
            PyErr_SetString(PyExc_TypeError, "copy_spans: offset and n must be ints");
            goto done;
        }
        int overflow = 0;
        long long off = PyLong_AsLongLongAndOverflow(o_off, &overflow);
        long long n = overflow ? 0 : PyLong_AsLongLongAndOverflow(o_n, &overflow);
        if (overflow || off < 0 || n < 0 || n > (long long)size || off > (long long)size - n) {
            PyErr_Format(PyExc_ValueError,
                         "copy_spans: span %zd is outside the mapped region of %zd bytes", i,
                         size);
            goto done;
        }
        int want = PyObject_IsTrue(PyTuple_GET_ITEM(t, 3));
        if (want < 0)
            goto done;
        if (take_buffer(PyTuple_GET_ITEM(t, 0), &views[i], "copy_spans", i, into) < 0)
            goto done;
        held++;
        if (n > (long long)views[i].len) {
            PyErr_Format(PyExc_ValueError,
                         "copy_spans: span %zd moves %lld bytes, its buffer has %zd", i, n,
                         views[i].len);
            goto done;
        }
        spans[i].local = views[i].buf;
        spans[i].off = (Py_ssize_t)off;
        spans[i].n = (Py_ssize_t)n;
        spans[i].want_hash = want;
    }
    state = XXH3_createState();
    if (state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t stopped = -1; /* index of the span the deadline stopped before */
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t since = CHECK_BYTES;
    char *base = (char *)(uintptr_t)base_addr;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (since >= CHECK_BYTES) {
            if (monotonic_now() >= stop_at) {
                stopped = i;
                break;
            }
            since = 0;
        }
        move_span(&spans[i], base, into, state);
        since += spans[i].n;
    }
#ifdef GC_STREAMING
    _mm_sfence(); /* streamed spans are visible to every core before the call returns */
#endif
    Py_END_ALLOW_THREADS
    if (stopped >= 0) {
        PyErr_SetString(PyExc_TimeoutError, "copy_spans: past the deadline");
        goto done;
    }
    out = PyList_New(count);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *d;
        if (spans[i].want_hash) {
            d = PyLong_FromUnsignedLongLong((unsigned long long)spans[i].digest);
            if (d == NULL) {
                Py_CLEAR(out);
                goto done;
            }
        } else {
            d = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(out, i, d);
    }
done:
    if (state != NULL)
        XXH3_freeState(state);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(spans);
    Py_DECREF(seq);
    return out;
}

typedef struct {
    char *local;
    Py_ssize_t n;
    long long off;
    int want_hash;
    int short_read;
    XXH64_hash_t digest;
} rspan_t;

#define PREAD_CHUNK ((Py_ssize_t)256 << 10) /* read, then hash, this much at a time */

/* read all n bytes at p from fd at off (pread, retried on EINTR and after a short
 * read): 0; -1 when the file ended first (what was there landed); or an errno */
static int pread_all(int fd, char *p, Py_ssize_t n, long long off) {
    Py_ssize_t done = 0;
    while (done < n) {
        ssize_t got = pread(fd, p + done, (size_t)(n - done), (off_t)(off + done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (got == 0)
            return -1;
        done += got;
    }
    return 0;
}

/* read all n bytes of s from fd (short_read set if the file ends first); 0, or errno */
static int pread_span(int fd, rspan_t *s, XXH3_state_t *state) {
    Py_ssize_t step = s->want_hash ? PREAD_CHUNK : s->n;
    if (s->want_hash)
        XXH3_64bits_reset(state);
    for (Py_ssize_t from = 0; from < s->n; from += step) {
        Py_ssize_t len = s->n - from < step ? s->n - from : step;
        int rc = pread_all(fd, s->local + from, len, s->off + from);
        if (rc > 0)
            return rc;
        if (rc < 0) {
            s->short_read = 1;
            return 0;
        }
        if (s->want_hash)
            GC_XXH3_UPDATE(state, s->local + from, (size_t)len);
    }
    if (s->want_hash)
        s->digest = XXH3_64bits_digest(state);
    return 0;
}

/* The fault guard of read_staged. A staging file is the client's: it may shrink it
 * while the server copies from a mapping of it, and an access past a mapped file's end
 * raises SIGBUS. While any thread copies from a mapping, bus_handler is the process's
 * SIGBUS handler (installed by the first such thread, the previous one restored by the
 * last): a fault inside the span the faulting thread is copying jumps back to that
 * copy (siglongjmp), which reports the span short, as a pread that found the file's end
 * would. Any other SIGBUS gets what it would have got without the guard: the previous
 * handler, or the default action (the process ends). SA_NODEFER keeps SIGBUS unblocked
 * in the handler, so the jump needs no signal mask saved (sigsetjmp(jb, 0): no
 * syscall per span). The guard is per thread (initial-exec TLS: no allocation on its
 * first touch inside the handler). */
typedef struct {
    sigjmp_buf *jb; /* set only while this thread copies [lo, hi) from a mapping */
    const char *lo, *hi;
} guard_t;
static __thread guard_t guard __attribute__((tls_model("initial-exec")));
static pthread_mutex_t guard_mu = PTHREAD_MUTEX_INITIALIZER;
static int guard_users;
static struct sigaction guard_prev;

static void bus_handler(int sig, siginfo_t *si, void *uc) {
    sigjmp_buf *jb = guard.jb;
    const char *at = (const char *)si->si_addr;
    if (jb != NULL && si->si_code > 0 && at >= guard.lo && at < guard.hi) {
        guard.jb = NULL;
        siglongjmp(*jb, 1);
    }
    if ((guard_prev.sa_flags & SA_SIGINFO) && guard_prev.sa_sigaction != NULL) {
        guard_prev.sa_sigaction(sig, si, uc);
        return;
    }
    if (!(guard_prev.sa_flags & SA_SIGINFO) && guard_prev.sa_handler != SIG_DFL &&
        guard_prev.sa_handler != SIG_IGN) {
        guard_prev.sa_handler(sig);
        return;
    }
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig);
}

/* this thread is about to copy from mappings: 0 once bus_handler is installed, -1 if it
 * cannot be (the caller then preads) */
static int guard_enter(void) {
    int rc = 0;
    pthread_mutex_lock(&guard_mu);
    if (guard_users == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = bus_handler;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        rc = sigaction(SIGBUS, &sa, &guard_prev);
    }
    if (rc == 0)
        guard_users++;
    pthread_mutex_unlock(&guard_mu);
    return rc;
}

static void guard_leave(void) {
    pthread_mutex_lock(&guard_mu);
    if (--guard_users == 0)
        sigaction(SIGBUS, &guard_prev, NULL);
    pthread_mutex_unlock(&guard_mu);
}

/* copy span s from map (the file's bytes [s->off, s->off + s->n) lie inside it), hashing
 * what landed chunk by chunk when asked; the span is short when the file shrank under
 * the copy. Runs between guard_enter and guard_leave. */
static void map_span(const char *map, rspan_t *s, XXH3_state_t *state) {
    sigjmp_buf jb;
    const char *src = map + s->off;
    guard.lo = src;
    guard.hi = src + s->n;
    guard.jb = &jb;
    if (sigsetjmp(jb, 0) != 0) { /* bus_handler cleared guard.jb */
        s->short_read = 1;
        return;
    }
    if (!s->want_hash) {
        if (s->n)
            memcpy(s->local, src, (size_t)s->n);
    } else {
        XXH3_64bits_reset(state);
        for (Py_ssize_t done = 0; done < s->n; done += HASH_CHUNK) {
            Py_ssize_t k = s->n - done < HASH_CHUNK ? s->n - done : HASH_CHUNK;
            memcpy(s->local + done, src + done, (size_t)k);
            GC_XXH3_UPDATE(state, s->local + done, (size_t)k);
        }
        s->digest = XXH3_64bits_digest(state);
    }
    guard.jb = NULL;
}

/* the body of pread_spans and read_staged: fill the spans of spans_obj from fd, each
 * span that lies inside map (map_len bytes mapping the file's start; NULL: none)
 * copied from it instead; fn names the calling function in error messages */
static PyObject *read_spans(const char *fn, int fd, PyObject *spans_obj, const char *map,
                            Py_ssize_t map_len) {
    char msg[80];
    snprintf(msg, sizeof msg, "%s: spans must be a sequence", fn);
    Py_ssize_t count;
    PyObject **items;
    PyObject *seq = fast_items(spans_obj, msg, &count, &items);
    if (seq == NULL)
        return NULL;
    rspan_t *spans = NULL;
    Py_buffer *views = NULL;
    PyObject *out = NULL, *digests = NULL, *shorts = NULL;
    Py_ssize_t held = 0;
    XXH3_state_t *state = NULL;
    if (alloc_spans(count, sizeof(rspan_t), (void **)&spans, &views) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = items[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
            PyErr_Format(PyExc_TypeError,
                         "%s: a span is a tuple (buffer, file_offset, want_hash)", fn);
            goto done;
        }
        PyObject *o_off = PyTuple_GET_ITEM(t, 1);
        if (!PyLong_Check(o_off)) {
            PyErr_Format(PyExc_TypeError, "%s: file_offset must be an int", fn);
            goto done;
        }
        int overflow = 0;
        long long off = PyLong_AsLongLongAndOverflow(o_off, &overflow);
        if (overflow || off < 0) {
            PyErr_Format(PyExc_ValueError, "%s: span %zd's file offset is out of range", fn,
                         i);
            goto done;
        }
        int want = PyObject_IsTrue(PyTuple_GET_ITEM(t, 2));
        if (want < 0)
            goto done;
        if (take_buffer(PyTuple_GET_ITEM(t, 0), &views[i], fn, i, 1) < 0)
            goto done;
        held++;
        if (views[i].len > LLONG_MAX - off) {
            PyErr_Format(PyExc_ValueError, "%s: span %zd's file offset is out of range", fn,
                         i);
            goto done;
        }
        spans[i].local = views[i].buf;
        spans[i].n = views[i].len;
        spans[i].off = off;
        spans[i].want_hash = want;
    }
    state = XXH3_createState();
    if (state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    int guarded = map != NULL && guard_enter() == 0;
    for (Py_ssize_t i = 0; i < count && err == 0; i++) {
        if (guarded && spans[i].off <= (long long)map_len - spans[i].n)
            map_span(map, &spans[i], state);
        else
            err = pread_span(fd, &spans[i], state);
    }
    if (guarded)
        guard_leave();
    Py_END_ALLOW_THREADS
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    digests = PyList_New(count);
    shorts = PyList_New(0);
    if (digests == NULL || shorts == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *d;
        if (spans[i].short_read) {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (idx == NULL || PyList_Append(shorts, idx) < 0) {
                Py_XDECREF(idx);
                goto done;
            }
            Py_DECREF(idx);
            d = Py_NewRef(Py_None);
        } else if (spans[i].want_hash) {
            d = PyLong_FromUnsignedLongLong((unsigned long long)spans[i].digest);
            if (d == NULL)
                goto done;
        } else {
            d = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(digests, i, d);
    }
    out = PyTuple_Pack(2, digests, shorts);
done:
    Py_XDECREF(digests);
    Py_XDECREF(shorts);
    if (state != NULL)
        XXH3_freeState(state);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(spans);
    Py_DECREF(seq);
    return out;
}

static PyObject *pread_spans(PyObject *self, PyObject *args) {
    int fd;
    PyObject *spans_obj;
    if (!PyArg_ParseTuple(args, "iO:pread_spans", &fd, &spans_obj))
        return NULL;
    return read_spans("pread_spans", fd, spans_obj, NULL, 0);
}

static PyObject *read_staged(PyObject *self, PyObject *args) {
    int fd;
    PyObject *map_obj, *spans_obj;
    if (!PyArg_ParseTuple(args, "iOO:read_staged", &fd, &map_obj, &spans_obj))
        return NULL;
    if (map_obj == Py_None)
        return read_spans("read_staged", fd, spans_obj, NULL, 0);
    Py_buffer map;
    if (PyObject_GetBuffer(map_obj, &map, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError,
                        "read_staged: mapping must be None or a C-contiguous buffer");
        return NULL;
    }
    PyObject *out = read_spans("read_staged", fd, spans_obj, (const char *)map.buf, map.len);
    PyBuffer_Release(&map);
    return out;
}

typedef struct {
    int fd;
    char *local;
    Py_ssize_t n;
    long long off;
    Py_ssize_t hash_from, hash_to;
    int err; /* -1: read and hashed; 0: the file ended first; > 0: errno */
    XXH64_hash_t digest;
} rec_t;

/* an int argument of span i in [lo, hi] (TypeError unless an int, ValueError outside) */
static int span_int(PyObject *o, long long lo, long long hi, long long *out,
                    const char *what, Py_ssize_t i) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "pread_records: span %zd's %s must be an int", i, what);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "pread_records: span %zd's %s is out of range", i,
                     what);
        return -1;
    }
    *out = v;
    return 0;
}

/* read all of r's buffer, then hash its [hash_from, hash_to); sets r->err */
static void pread_record(rec_t *r) {
    int rc = pread_all(r->fd, r->local, r->n, r->off);
    if (rc != 0) {
        r->err = rc > 0 ? rc : 0; /* 0: the file ended first */
        return;
    }
    r->digest = GC_XXH3(r->local + r->hash_from, (size_t)(r->hash_to - r->hash_from));
    r->err = -1;
}

static PyObject *pread_records(PyObject *self, PyObject *args) {
    PyObject *spans_obj;
    if (!PyArg_ParseTuple(args, "O:pread_records", &spans_obj))
        return NULL;
    Py_ssize_t count;
    PyObject **items;
    PyObject *seq = fast_items(spans_obj, "pread_records: spans must be a sequence", &count,
                               &items);
    if (seq == NULL)
        return NULL;
    rec_t *recs = NULL;
    Py_buffer *views = NULL;
    PyObject *out = NULL, *digests = NULL, *failed = NULL;
    Py_ssize_t held = 0;
    if (alloc_spans(count, sizeof(rec_t), (void **)&recs, &views) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = items[i];
        long long fd, off, hfrom, hto;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5) {
            PyErr_SetString(PyExc_TypeError, "pread_records: a span is a tuple (fd, buffer, "
                            "file_offset, hash_from, hash_to)");
            goto done;
        }
        if (span_int(PyTuple_GET_ITEM(t, 0), INT_MIN, INT_MAX, &fd, "fd", i) < 0
                || span_int(PyTuple_GET_ITEM(t, 2), 0, LLONG_MAX, &off, "file offset", i) < 0
                || span_int(PyTuple_GET_ITEM(t, 3), 0, LLONG_MAX, &hfrom, "hash range",
                            i) < 0
                || span_int(PyTuple_GET_ITEM(t, 4), 0, LLONG_MAX, &hto, "hash range", i) < 0)
            goto done;
        if (take_buffer(PyTuple_GET_ITEM(t, 1), &views[i], "pread_records", i, 1) < 0)
            goto done;
        held++;
        if (views[i].len > LLONG_MAX - off) {
            PyErr_Format(PyExc_ValueError, "pread_records: span %zd's file offset is out of "
                         "range", i);
            goto done;
        }
        if (hfrom > hto || hto > (long long)views[i].len) {
            PyErr_Format(PyExc_ValueError, "pread_records: span %zd's hash range is out of "
                         "range", i);
            goto done;
        }
        recs[i].fd = (int)fd;
        recs[i].local = views[i].buf;
        recs[i].n = views[i].len;
        recs[i].off = off;
        recs[i].hash_from = (Py_ssize_t)hfrom;
        recs[i].hash_to = (Py_ssize_t)hto;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        pread_record(&recs[i]);
    Py_END_ALLOW_THREADS
    digests = PyList_New(count);
    failed = PyList_New(0);
    if (digests == NULL || failed == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *d;
        if (recs[i].err >= 0) {
            PyObject *f = Py_BuildValue("(ni)", i, recs[i].err);
            if (f == NULL || PyList_Append(failed, f) < 0) {
                Py_XDECREF(f);
                goto done;
            }
            Py_DECREF(f);
            d = Py_NewRef(Py_None);
        } else {
            d = PyLong_FromUnsignedLongLong((unsigned long long)recs[i].digest);
            if (d == NULL)
                goto done;
        }
        PyList_SET_ITEM(digests, i, d);
    }
    out = PyTuple_Pack(2, digests, failed);
done:
    Py_XDECREF(digests);
    Py_XDECREF(failed);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(recs);
    Py_DECREF(seq);
    return out;
}

static PyObject *placement_hashes(PyObject *self, PyObject *args) {
    Py_buffer ns;
    PyObject *keys_obj;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*OK:placement_hashes", &ns, &keys_obj, &seed))
        return NULL;
    Py_ssize_t count = 0;
    PyObject **items = NULL;
    PyObject *out = NULL, *seq = fast_items(keys_obj, "placement_hashes: keys must be a "
                                            "sequence", &count, &items);
    char stack[512];
    char *buf = stack;
    Py_ssize_t cap = (Py_ssize_t)sizeof(stack);
    if (seq == NULL)
        goto done;
    out = PyList_New(count);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *k = items[i];
        if (!PyBytes_Check(k)) {
            PyErr_Format(PyExc_TypeError, "placement_hashes: key %zd is %s, not bytes", i,
                         Py_TYPE(k)->tp_name);
            Py_CLEAR(out);
            goto done;
        }
        Py_ssize_t kn = PyBytes_GET_SIZE(k), need = ns.len + 1 + kn;
        if (need > cap) {
            char *bigger = PyMem_Malloc((size_t)need);
            if (bigger == NULL) {
                PyErr_NoMemory();
                Py_CLEAR(out);
                goto done;
            }
            if (buf != stack)
                PyMem_Free(buf);
            buf = bigger;
            cap = need;
        }
        memcpy(buf, ns.buf, (size_t)ns.len);
        buf[ns.len] = 0;
        memcpy(buf + ns.len + 1, PyBytes_AS_STRING(k), (size_t)kn);
        PyObject *h = PyLong_FromUnsignedLongLong(
            (unsigned long long)GC_XXH3_SEED(buf, (size_t)need, (XXH64_hash_t)seed));
        if (h == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, h);
    }
done:
    if (buf != stack)
        PyMem_Free(buf);
    Py_XDECREF(seq);
    PyBuffer_Release(&ns);
    return out;
}

/* checksums(buffers): xxh3_64 of each buffer, the GIL released once for all of them. */
static PyObject *checksums(PyObject *self, PyObject *arg) {
    Py_ssize_t count = 0, taken = 0;
    PyObject **items = NULL;
    PyObject *out = NULL, *seq = fast_items(arg, "checksums: buffers must be a sequence",
                                            &count, &items);
    Py_buffer *views = NULL;
    XXH64_hash_t *digests = NULL;
    if (seq == NULL)
        return NULL;
    if (alloc_spans(count, sizeof(XXH64_hash_t), (void **)&digests, &views) < 0)
        goto done;
    for (; taken < count; taken++) {
        PyObject *obj = items[taken];
        if (!PyObject_CheckBuffer(obj)) {
            PyErr_Format(PyExc_TypeError, "checksums: buffer %zd is %s, not a buffer", taken,
                         Py_TYPE(obj)->tp_name);
            goto done;
        }
        if (PyObject_GetBuffer(obj, &views[taken], PyBUF_SIMPLE) != 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "checksums: buffer %zd is not C-contiguous", taken);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        digests[i] = GC_XXH3(views[i].buf, (size_t)views[i].len);
    Py_END_ALLOW_THREADS
    out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong((unsigned long long)digests[i]);
        if (h == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, h);
    }
done:
    for (Py_ssize_t i = 0; i < taken; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(digests);
    Py_DECREF(seq);
    return out;
}

/* recv_views(sock, views, want, stop_at): fill the views in order from a stream socket,
 * hashing the flagged ones as their bytes land, the GIL released throughout. */
#define RECV_IOV 512                        /* buffers per recvmsg (protocol._IOV_MAX) */
#define RECV_HASH_BYTES ((size_t)256 << 10) /* bytes per recvmsg while hashing */

typedef struct {
    char *p;
    Py_ssize_t n;
    int want;
    XXH64_hash_t digest;
} vspan_t;

enum { RECV_OK, RECV_EOF, RECV_TIMEOUT, RECV_ERRNO, RECV_SIGNAL };

/* account k bytes that landed from view *cur on (at *pos of it), hashing flagged views'
 * new bytes: a view landed whole in one read is hashed in one pass, else in the state
 * (only one view can be part-filled at a time) */
static void recv_landed(vspan_t *v, Py_ssize_t count, Py_ssize_t *cur, Py_ssize_t *pos,
                        size_t k, XXH3_state_t *state) {
    while (k > 0 && *cur < count) {
        vspan_t *s = &v[*cur];
        size_t m = (size_t)(s->n - *pos) < k ? (size_t)(s->n - *pos) : k;
        if (s->want) {
            if (*pos == 0 && (Py_ssize_t)m == s->n) {
                s->digest = GC_XXH3(s->p, m);
            } else {
                if (*pos == 0)
                    XXH3_64bits_reset(state);
                GC_XXH3_UPDATE(state, s->p + *pos, m);
                if (*pos + (Py_ssize_t)m == s->n)
                    s->digest = XXH3_64bits_digest(state);
            }
        }
        *pos += (Py_ssize_t)m;
        k -= m;
        if (*pos == s->n) {
            *pos = 0;
            do
                (*cur)++;
            while (*cur < count && v[*cur].n == 0);
        }
    }
}

static PyObject *recv_views(PyObject *self, PyObject *args) {
    PyObject *sock, *views_obj, *want_obj;
    double stop_at;
    if (!PyArg_ParseTuple(args, "OOOd:recv_views", &sock, &views_obj, &want_obj, &stop_at))
        return NULL;
    if (isnan(stop_at)) {
        PyErr_SetString(PyExc_ValueError, "recv_views: stop_at is not a number");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0)
        return NULL;
    Py_ssize_t count, nwant = 0;
    PyObject **items, **wants = NULL;
    PyObject *wseq = NULL, *out = NULL;
    PyObject *seq = fast_items(views_obj, "recv_views: views must be a sequence", &count,
                               &items);
    if (seq == NULL)
        return NULL;
    vspan_t *v = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t held = 0;
    XXH3_state_t *state = NULL;
    if (want_obj != Py_None) {
        wseq = fast_items(want_obj, "recv_views: want must be None or a sequence", &nwant,
                          &wants);
        if (wseq == NULL)
            goto done;
        if (nwant != count) {
            PyErr_Format(PyExc_ValueError, "recv_views: want has %zd flags for %zd views",
                         nwant, count);
            goto done;
        }
    }
    if (alloc_spans(count, sizeof(vspan_t), (void **)&v, &bufs) < 0)
        goto done;
    int any_want = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int w = 0;
        if (wants != NULL && (w = PyObject_IsTrue(wants[i])) < 0)
            goto done;
        if (take_buffer(items[i], &bufs[i], "recv_views", i, 1) < 0)
            goto done;
        held++;
        v[i].p = bufs[i].buf;
        v[i].n = bufs[i].len;
        v[i].want = w;
        any_want |= w;
        if (w && v[i].n == 0)
            v[i].digest = GC_XXH3(v[i].p, 0);
    }
    state = XXH3_createState();
    if (state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int err = RECV_OK, saved = 0;
    Py_ssize_t cur = 0, pos = 0;
    while (cur < count && v[cur].n == 0)
        cur++;
    Py_BEGIN_ALLOW_THREADS
    struct iovec iov[RECV_IOV];
    while (cur < count) {
        if (monotonic_now() >= stop_at) {
            err = RECV_TIMEOUT;
            break;
        }
        int j = 0;
        size_t room = any_want ? RECV_HASH_BYTES : (size_t)-1, total = 0;
        for (Py_ssize_t i = cur; i < count && j < RECV_IOV && total < room; i++) {
            Py_ssize_t off = i == cur ? pos : 0;
            size_t len = (size_t)(v[i].n - off);
            if (len == 0)
                continue;
            if (len > room - total)
                len = room - total;
            iov[j].iov_base = v[i].p + off;
            iov[j].iov_len = len;
            j++;
            total += len;
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)j;
        ssize_t k = recvmsg(fd, &mh, MSG_DONTWAIT);
        if (k > 0) {
            recv_landed(v, count, &cur, &pos, (size_t)k, state);
            continue;
        }
        if (k == 0) {
            err = RECV_EOF;
            break;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            double left = stop_at - monotonic_now();
            if (left <= 0) {
                err = RECV_TIMEOUT;
                break;
            }
            double ms = ceil(left * 1000.0);
            struct pollfd pf = {fd, POLLIN, 0};
            if (poll(&pf, 1, ms > INT_MAX ? INT_MAX : (int)ms) >= 0)
                continue; /* ready, or the time is up: the loop's clock decides */
            if (errno != EINTR) {
                saved = errno;
                err = RECV_ERRNO;
                break;
            }
        }
        if (errno == EINTR) {
            int bad;
            Py_BLOCK_THREADS
            bad = PyErr_CheckSignals();
            Py_UNBLOCK_THREADS
            if (bad) {
                err = RECV_SIGNAL;
                break;
            }
            continue;
        }
        saved = errno;
        err = RECV_ERRNO;
        break;
    }
    Py_END_ALLOW_THREADS
    if (err == RECV_TIMEOUT) {
        PyErr_SetString(PyExc_TimeoutError, "deadline passed");
        goto done;
    }
    if (err == RECV_EOF) {
        PyErr_SetString(PyExc_ConnectionError,
                        "peer closed the connection in the middle of a payload");
        goto done;
    }
    if (err == RECV_ERRNO) {
        errno = saved;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (err == RECV_SIGNAL)
        goto done;
    out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *d = v[i].want ? PyLong_FromUnsignedLongLong((unsigned long long)v[i].digest)
                                : Py_NewRef(Py_None);
        if (d == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, d);
    }
done:
    if (state != NULL)
        XXH3_freeState(state);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(v);
    Py_XDECREF(wseq);
    Py_DECREF(seq);
    return out;
}

/* exchange(sock, request, view, at_least, stop_at): send a request whole, then receive
 * the start of its reply, the GIL released for both. */
enum { XCH_OK, XCH_EOF, XCH_TIMEOUT, XCH_ERRNO, XCH_SIGNAL };

static PyObject *exchange(PyObject *self, PyObject *args) {
    PyObject *sock, *req_obj, *view_obj;
    Py_ssize_t at_least;
    double stop_at;
    if (!PyArg_ParseTuple(args, "OOOnd:exchange", &sock, &req_obj, &view_obj, &at_least,
                          &stop_at))
        return NULL;
    if (isnan(stop_at)) {
        PyErr_SetString(PyExc_ValueError, "exchange: stop_at is not a number");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0)
        return NULL;
    Py_buffer req, view;
    if (PyObject_GetBuffer(req_obj, &req, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "exchange: the request is not a C-contiguous buffer");
        return NULL;
    }
    if (take_buffer(view_obj, &view, "exchange", 0, 1) < 0) {
        PyBuffer_Release(&req);
        return NULL;
    }
    PyObject *out = NULL;
    if (at_least < 1 || at_least > view.len) {
        PyErr_Format(PyExc_ValueError, "exchange: at_least %zd is not within the view's "
                     "1..%zd bytes", at_least, view.len);
        goto done;
    }
    int err = XCH_OK, saved = 0;
    Py_ssize_t sent = 0, got = 0;
    Py_BEGIN_ALLOW_THREADS
    while (sent < req.len || got < at_least) {
        int sending = sent < req.len;
        if (monotonic_now() >= stop_at) {
            err = XCH_TIMEOUT;
            break;
        }
        ssize_t k = sending
            ? send(fd, (char *)req.buf + sent, (size_t)(req.len - sent),
                   MSG_DONTWAIT | MSG_NOSIGNAL)
            : recv(fd, (char *)view.buf + got, (size_t)(view.len - got), MSG_DONTWAIT);
        if (k > 0) {
            if (sending)
                sent += k;
            else
                got += k;
            continue;
        }
        if (k == 0 && !sending) {
            err = XCH_EOF;
            break;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            double left = stop_at - monotonic_now();
            if (left <= 0) {
                err = XCH_TIMEOUT;
                break;
            }
            double ms = ceil(left * 1000.0);
            struct pollfd pf = {fd, sending ? POLLOUT : POLLIN, 0};
            if (poll(&pf, 1, ms > INT_MAX ? INT_MAX : (int)ms) >= 0)
                continue; /* ready, or the time is up: the loop's clock decides */
        }
        if (k < 0 && errno == EINTR) {
            int bad;
            Py_BLOCK_THREADS
            bad = PyErr_CheckSignals();
            Py_UNBLOCK_THREADS
            if (bad) {
                err = XCH_SIGNAL;
                break;
            }
            continue;
        }
        saved = k < 0 ? errno : EIO; /* a send of 0 bytes: never for a non-empty request */
        err = XCH_ERRNO;
        break;
    }
    Py_END_ALLOW_THREADS
    if (err == XCH_TIMEOUT)
        PyErr_SetString(PyExc_TimeoutError, "deadline passed");
    else if (err == XCH_EOF)
        PyErr_Format(PyExc_ConnectionError, "peer closed the connection after %zd bytes of "
                     "a reply", got);
    else if (err == XCH_ERRNO) {
        errno = saved;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (err == XCH_OK)
        out = PyLong_FromSsize_t(got);
done:
    PyBuffer_Release(&view);
    PyBuffer_Release(&req);
    return out;
}

/* byte_views(objs, writable): as_view (sdk/buffers.py) for host buffers, one call per
 * batch: a flat, C-contiguous, unsigned-byte memoryview of each object, no copy. */
static PyObject *byte_views(PyObject *self, PyObject *args) {
    PyObject *objs;
    int writable;
    if (!PyArg_ParseTuple(args, "Op:byte_views", &objs, &writable))
        return NULL;
    Py_ssize_t count;
    PyObject **items;
    PyObject *seq = fast_items(objs, "byte_views: objs must be a sequence", &count, &items);
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(count);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *mv = PyMemoryView_FromObject(items[i]);
        if (mv == NULL)
            goto fail;
        Py_buffer *v = PyMemoryView_GET_BUFFER(mv);
        if (!PyBuffer_IsContiguous(v, 'A')) {
            Py_DECREF(mv);
            PyErr_SetString(PyExc_ValueError, "buffer must be C-contiguous");
            goto fail;
        }
        if (writable && v->readonly) {
            Py_DECREF(mv);
            PyErr_SetString(PyExc_ValueError, "destination buffer is read-only");
            goto fail;
        }
        if (v->ndim != 1 || (v->format != NULL && strcmp(v->format, "B") != 0)) {
            PyObject *cast = PyObject_CallMethod(mv, "cast", "s", "B");
            Py_DECREF(mv);
            if (cast == NULL)
                goto fail;
            mv = cast;
        }
        PyList_SET_ITEM(out, i, mv);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* ------------------------------------------------------------------ arena headers */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the arena's headers are little-endian: build without the native module here"
#endif
#define HDR_FIXED 64
#define CHUNK_MAGIC 0x4F434347u
#define FLAG_COMMITTED 0x1u
#define FLAG_PLACED 0x2u

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* zlib.crc32(p[:n], crc) */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--)
        crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static void put_u16(char *p, uint16_t v) { memcpy(p, &v, 2); } /* little-endian hosts */
static void put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_u64(char *p, uint64_t v) { memcpy(p, &v, 8); }

/* the writable, C-contiguous buffer of obj: 0, or -1 with TypeError / ValueError */
static int arena_buffer(PyObject *obj, Py_buffer *view, const char *fn) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        if (PyObject_CheckBuffer(obj)) {
            PyErr_Format(PyExc_ValueError, "%s: the buffer is not C-contiguous", fn);
            return -1;
        }
        PyErr_Format(PyExc_TypeError, "%s: %s is not a buffer", fn, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (view->readonly) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: the buffer is read-only", fn);
        return -1;
    }
    return 0;
}

/* an int argument as a ssize_t: 0, or -1 with TypeError / OverflowError */
static int arg_ssize(PyObject *o, Py_ssize_t *out, const char *fn, const char *what) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int, not %s", fn, what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsSsize_t(o);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s: %s does not fit a C ssize_t", fn, what);
        return -1;
    }
    return 0;
}

/* an int argument as an unsigned 64-bit value: 0, or -1 with TypeError / OverflowError */
static int arg_u64(PyObject *o, uint64_t *out, const char *fn, const char *what) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int, not %s", fn, what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s: %s is not an unsigned 64-bit int", fn, what);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *header_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *fn = "header_write";
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "%s takes 9 arguments (%zd given)", fn, nargs);
        return NULL;
    }
    Py_buffer view;
    if (arena_buffer(args[0], &view, fn) < 0)
        return NULL;
    Py_ssize_t off, mark_at;
    uint64_t version, length, created, ph = 0;
    PyObject *ns = args[2], *key = args[3], *ph_obj = args[7];
    int placed = ph_obj != Py_None;
    if (arg_ssize(args[1], &off, fn, "off") < 0)
        goto fail;
    if (!PyBytes_CheckExact(ns) || !PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "%s: the namespace and the key must be bytes", fn);
        goto fail;
    }
    if (arg_u64(args[4], &version, fn, "version") < 0
            || arg_u64(args[5], &length, fn, "length") < 0
            || arg_u64(args[6], &created, fn, "created_ns") < 0
            || (placed && arg_u64(ph_obj, &ph, fn, "ph") < 0)
            || arg_ssize(args[8], &mark_at, fn, "mark_at") < 0)
        goto fail;
    Py_ssize_t ns_len = PyBytes_GET_SIZE(ns), key_len = PyBytes_GET_SIZE(key);
    if (ns_len > 0xFFFF || key_len > 0xFFFF) {
        PyErr_Format(PyExc_ValueError, "%s: a namespace or key over 65535 bytes", fn);
        goto fail;
    }
    Py_ssize_t hl = (HDR_FIXED + ns_len + key_len + (placed ? 8 : 0) + 63) & ~(Py_ssize_t)63;
    if (off < 0 || off > view.len - hl) {
        PyErr_Format(PyExc_ValueError, "%s: a %zd-byte header at %zd is outside the buffer",
                     fn, hl, off);
        goto fail;
    }
    if (mark_at < 0 || mark_at >= view.len) {
        PyErr_Format(PyExc_ValueError, "%s: start mark %zd is outside the buffer", fn,
                     mark_at);
        goto fail;
    }
    char *h = (char *)view.buf + off;
    put_u32(h, CHUNK_MAGIC);
    put_u32(h + 4, placed ? FLAG_PLACED : 0);
    put_u16(h + 8, (uint16_t)hl);
    put_u16(h + 10, (uint16_t)ns_len);
    put_u16(h + 12, (uint16_t)key_len);
    put_u16(h + 14, 0);
    put_u64(h + 16, version);
    put_u64(h + 24, length);
    put_u64(h + 32, 0);
    put_u64(h + 40, created);
    put_u32(h + 48, 0);
    put_u32(h + 52, 0);
    memcpy(h + HDR_FIXED, PyBytes_AS_STRING(ns), (size_t)ns_len);
    memcpy(h + HDR_FIXED + ns_len, PyBytes_AS_STRING(key), (size_t)key_len);
    if (placed)
        put_u64(h + HDR_FIXED + ns_len + key_len, ph);
    ((char *)view.buf)[mark_at] = 1; /* after the header: a start mark names a header */
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(off + hl);
fail:
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *header_commit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *fn = "header_commit";
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s takes 3 arguments (%zd given)", fn, nargs);
        return NULL;
    }
    Py_buffer view;
    if (arena_buffer(args[0], &view, fn) < 0)
        return NULL;
    Py_ssize_t off;
    uint64_t csum;
    if (arg_ssize(args[1], &off, fn, "off") < 0 || arg_u64(args[2], &csum, fn, "csum") < 0)
        goto fail;
    if (off < 0 || off > view.len - HDR_FIXED) {
        PyErr_Format(PyExc_ValueError, "%s: a header at %zd is outside the buffer", fn, off);
        goto fail;
    }
    unsigned char *h = (unsigned char *)view.buf + off;
    uint32_t flags;
    uint16_t ns_len, key_len;
    memcpy(&flags, h + 4, 4);
    memcpy(&ns_len, h + 10, 2);
    memcpy(&key_len, h + 12, 2);
    Py_ssize_t tail = (Py_ssize_t)ns_len + key_len + ((flags & FLAG_PLACED) ? 8 : 0);
    if (off + HDR_FIXED + tail > view.len) {
        PyErr_Format(PyExc_ValueError, "%s: the header at %zd runs past the buffer", fn, off);
        goto fail;
    }
    put_u64((char *)h + 32, csum);
    uint32_t crc = crc32_update(0, h + 8, 40);
    crc = crc32_update(crc, h + HDR_FIXED, (size_t)tail);
    put_u32((char *)h + 48, crc);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* the flag last: after checksum and CRC */
    put_u32((char *)h + 4, flags | FLAG_COMMITTED);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&view);
    return NULL;
}

static PyMethodDef methods[] = {
    {"byte_views", byte_views, METH_VARARGS,
     "byte_views(objs, writable) -> list of flat unsigned-byte memoryviews"},
    {"checksums", checksums, METH_O,
     "checksums(buffers) -> list of xxh3_64 digests (the GIL released)"},
    {"copy_spans", copy_spans, METH_VARARGS,
     "copy_spans(spans, base, size, into, stop_at) -> list of digests or None"},
    {"recv_views", recv_views, METH_VARARGS,
     "recv_views(sock, views, want, stop_at) -> list of digests or None (the GIL released)"},
    {"exchange", exchange, METH_VARARGS,
     "exchange(sock, request, view, at_least, stop_at) -> bytes received (the GIL released)"},
    {"pread_spans", pread_spans, METH_VARARGS,
     "pread_spans(fd, spans) -> (digests or None, indices of short spans)"},
    {"read_staged", read_staged, METH_VARARGS,
     "read_staged(fd, mapping, spans) -> pread_spans's results, copying from the mapping"},
    {"pread_records", pread_records, METH_VARARGS,
     "pread_records(spans) -> (digests or None, (index, errno) of failed spans)"},
    {"placement_hashes", placement_hashes, METH_VARARGS,
     "placement_hashes(namespace, keys, seed) -> list of xxh3_64 ring positions"},
    {"header_write", (PyCFunction)(void (*)(void))header_write, METH_FASTCALL,
     "header_write(buf, off, ns, key, version, length, created_ns, ph, mark_at) -> data "
     "offset"},
    {"header_commit", (PyCFunction)(void (*)(void))header_commit, METH_FASTCALL,
     "header_commit(buf, off, csum): checksum, header CRC32, then FLAG_COMMITTED"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gcache._native",
    "C twins of gcache.native's pure-Python functions (see native/README.md).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "CHECK_BYTES", (long)CHECK_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
