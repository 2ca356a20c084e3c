#!/usr/bin/env bash
# Run the tests that reach gcache._native against a build of it instrumented with
# AddressSanitizer and UndefinedBehaviorSanitizer (`make test` runs this last).
#
# Why: the C functions read what peers send (recv_views: a TCP payload; read_staged: a
# client's staging file; pread_records: the disk tier) and write into caller buffers
# and the shm arena. An out-of-bounds write there is not an exception but a corrupted
# server, and the differential tests alone cannot see one that happens to leave the
# right bytes. Under ASan any such access aborts the test with a report instead.
#
# How: the extension is built into a scratch directory (never over the real build) next
# to a copy of the `gcache` package's Python files; PYTHONPATH puts that copy first, so
# `gcache._native` is the instrumented build while gcache.server, gcache.sdk, ... still
# come from this tree (the editable install). The sanitizer runtimes are preloaded into
# the interpreter (CPython itself is not instrumented) and inherited by the servers the
# tests start, so their C calls are checked too. Leak checking is off: the interpreter
# keeps objects alive at exit by design. ASan's SIGBUS handler is off: read_staged's own
# guard must see a shrunk staging file's SIGBUS (test_native_read_staged.py).
#
# Usage: native/sanitize.sh [PYTHON] [pytest args...]; PYTHON defaults to .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${1:-.venv/bin/python}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, the venv's own (no realpath)
shift || true

asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
for lib in "$asan" "$ubsan"; do
  if [ ! -e "$lib" ]; then
    echo "native/sanitize.sh: gcc has no $(basename "$lib") (Debian: apt-get install" \
         "libasan8 libubsan1); cannot run the sanitizer tests" >&2
    exit 2
  fi
done

work=$(mktemp -d /tmp/gcache-sanitize-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site/gcache"
# the package's Python files only (a stale or real _native build must not shadow ours)
(cd gcache && find . -name '*.py' -o -name py.typed) | while read -r f; do
  mkdir -p "$work/site/gcache/$(dirname "$f")"
  cp "gcache/$f" "$work/site/gcache/$f"
done
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CFLAGS="$flags -g" LDFLAGS="-fsanitize=address,undefined" \
  "$PY" setup.py -q build_ext --build-lib "$work/site" --build-temp "$work/tmp" \
  > "$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
so=$(ls "$work"/site/gcache/_native*.so 2>/dev/null || true)
if [ -z "$so" ]; then  # setup.py's Extension is optional: a failed build is not an error
  cat "$work/build.log" >&2
  echo "native/sanitize.sh: the instrumented build of gcache._native failed (above)" >&2
  exit 1
fi

# the differential tests of every native function, and the tests that drive them
# through real servers and clients (shm gets and staged puts, TCP payloads, the disk
# tier's grouped reads), and hostile peers: truncated put payloads to a server, lying
# replies to a client, a staging file cut under a put
cd "$root/tests"
tests=(core/test_native_*.py core/test_recv_into_many_hashes_as_bytes_land.py
       core/test_frame_reader_feeds_leftover_bytes_to_next_read.py
       sdk/test_shm_transport.py::test_shm_round_trip_every_form
       sdk/test_shm_get_checks_checksums_as_bytes_land.py
       sdk/test_shm_client_cannot_write_the_arena.py::test_shm_puts_round_trip_byte_exact_staged
       server/test_disk_read_many_group_matches_read.py
       server/test_malformed_frames.py::test_truncated_put_payload_is_never_readable
       server/test_malformed_frames.py::test_truncated_second_slice_of_sliced_put
       sdk/test_hostile_server_replies.py sdk/test_one_item_reply_path.py
       sdk/test_staging_file_cut_under_load.py)

export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
export LD_PRELOAD="$asan $ubsan"
# reports go to files (pytest captures stderr, and an aborted process never prints it);
# any report fails the run, and is shown
export ASAN_OPTIONS="detect_leaks=0:handle_sigbus=0:abort_on_error=1:log_path=$work/report"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/report"
# every Python object from malloc, so ASan guards small buffers too (pymalloc's arenas
# are mappings it does not track)
export PYTHONMALLOC=malloc
unset GCACHE_NATIVE
# from a directory without a gcache package in it: python puts its working directory
# ahead of PYTHONPATH, and the tree's own gcache/ would win
cd "$work"
# the instrumented build is the one that runs, or this proves nothing
"$PY" -c "import sys, gcache.native as m; sys.exit(0 if m.ACTIVE == 'native' and \
m._mod.__file__ == '$so' else 'native/sanitize.sh: gcache._native is not the instrumented \
build (' + str(getattr(m._mod, '__file__', m.ACTIVE)) + ')')"
# (no RSS bound is among them: ASan's redzones and its quarantine of freed memory are
# resident too, so test_malformed_frames' memory bounds do not hold under it)
rc=0
"$PY" -m pytest -q -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" \
  -n "${TEST_WORKERS:-2}" --dist loadfile "${tests[@]/#/$root/tests/}" "$@" || rc=$?
if compgen -G "$work/report.*" > /dev/null; then
  cat "$work"/report.* >&2
  echo "native/sanitize.sh: the sanitizers reported the errors above" >&2
  exit 1
fi
exit "$rc"
