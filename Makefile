# Two commands: `make run` and `make test`. Each creates the venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test venv bench bench-transports lint clean

# Every install takes the exact versions of constraints.txt (pyproject's extras are ranges).
PIP := $(BIN)/pip install -q -c constraints.txt

$(STAMP): pyproject.toml constraints.txt setup.py native/gcache_native.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# torch is pinned: 2.13.0 is the CPU wheel on local disk; any other spec pulls CUDA builds.
	# nixl-cu12 (the nixl transport) depends on torch: install it in the same command, or
	# pip resolves it against a 5.7 GB CUDA torch.
	$(PIP) 'torch==2.13.0' nixl-cu12
	$(PIP) -e '.[test]'
	# SGLang for tests/sglang: --no-deps, because its declared deps pull a CUDA torch and
	# kernels; the `sglang` extra (inside `test`) holds the CPU-only set it needs. Idempotent.
	$(PIP) --no-deps sglang
	# vLLM for the KV-event test (its classes decode what servers publish): --no-deps for
	# the same reason; the `vllm` extra (inside `test`) holds the CPU-only set it needs.
	$(PIP) --no-deps vllm
	touch $(STAMP)

## make venv: the venv, and Debian's chromium + chromium-driver for the cluster page's
## browser test (tests/master/test_cluster_page_in_chromium.py). Idempotent: apt runs only
## when one is missing, and only as root (CI); otherwise one line says what to install.
venv: $(STAMP)
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get install -y -q chromium chromium-driver || \
	  { apt-get update -q && apt-get install -y -q chromium chromium-driver; }; \
	else echo "chromium or chromedriver missing: as root, apt-get install chromium chromium-driver (the browser test fails under make test without them)"; fi

## make run: start a local 3-server cluster and drive a multi-turn KV-page workload through it.
run: $(STAMP)
	$(BIN)/gcache up --servers 3 --memory 512MiB --workload sessions

# Run again with the C extension switched off (GCACHE_NATIVE=0: the pure-Python twins),
# kept to ~30 s: the loader, and the shm paths that call copy_spans / placement_hashes
# (staged puts: copy_spans hashes each value as it copies it into the staging file), the
# disk tier's grouped reads (pread_records), TCP puts' value checksums (checksums), TCP
# gets' scatter reads hashed as they land (recv_views), one-item calls' round trips
# (exchange), and the arena's chunk headers (header_write / header_commit: written,
# then recovered).
NATIVE_OFF_TESTS = tests/core/test_native_loader.py tests/sdk/test_checksum_flip_never_a_hit.py \
	tests/core/test_recv_into_many_hashes_as_bytes_land.py \
	tests/sdk/test_shm_get_checks_checksums_as_bytes_land.py tests/sdk/test_shm_transport.py \
	tests/sdk/test_shm_client_cannot_write_the_arena.py \
	tests/server/test_disk_read_many_group_matches_read.py \
	tests/server/test_alloc_commit_without_write_publishes_nothing.py \
	tests/server/test_memory_tier_in_process.py tests/server/test_restart_survival.py \
	tests/sdk/test_one_item_reply_path.py \
	-k 'land or loader or flip or corrupt or round_trip_every_form or release_without_waiting or lease_expires or forged or staged or shrunk or group or memory_tier or restart_survival or one_item or small_pieces or read_ahead'

## make test: every test, with real gcache processes; then the native-off subset; then the
## tests that reach the C extension against an ASan + UBSan build of it (native/sanitize.sh).
# Two workers (pytest-xdist), one test file per worker at a time: most tests wait on real
# processes (heartbeats, handoffs, deadlines), so two files at once nearly halve the wall
# time on 2 cores. Every test keeps its own ports, arenas and temp dirs. The `serial`
# tests (read oracles through joins, drains and kills) run after, alone: their promise is
# "no miss", and a neighbour's CPU burst is not what they test. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
# GCACHE_REQUIRE_BROWSER: the browser test fails, not skips, without chromium.
test: venv
	GCACHE_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m 'not serial' --durations=25
	$(BIN)/python -m pytest -q -m serial --durations=10
	GCACHE_NATIVE=0 $(BIN)/python -m pytest -q $(NATIVE_OFF_TESTS)
	bash native/sanitize.sh $(BIN)/python

bench: $(STAMP)
	$(BIN)/gcache-bench --local 1 --op get --op put --size 64KiB --size 1MiB --size 4MiB --batch 64 --json bench/out/latest.json

## make bench-transports: tcp vs shm vs nixl over 64 KiB..64 MiB, table + PNG (bench/RESULTS.md)
bench-transports: $(STAMP)
	UCX_NET_DEVICES=$${UCX_NET_DEVICES:-lo} $(BIN)/gcache-bench --local 1 --memory 4GiB --op get --op put --sweep --batch 64 --transport tcp --transport shm --transport nixl --duration 2 --plot bench/out/transports.png --json bench/out/transports.json

clean:
	rm -rf $(VENV) build *.egg-info
