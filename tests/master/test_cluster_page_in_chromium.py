"""The live cluster page (``GET /ui`` on the master API, ``master/cluster_page.py``).

Its files answer without a credential and hold no cluster data, with a CSP; no other
name under ``/ui`` is served (no path traversal). In a real headless chromium (Selenium
driving Debian's ``chromium-driver``) against a real cluster, the page takes the
credential from the URL fragment and clears it from the address bar, shows the master's
refusal of a wrong one and asks again, then lists every member with its state and
memory, shows hit rate, ops/s, bytes/s and p99 numbers and chart points that move while
a client puts and gets, and a member's drain at the next poll; no CSP violation or
script error on the way.

Skips only when chromium or chromedriver is missing and ``GCACHE_REQUIRE_BROWSER`` is
unset (``make test`` sets it: there it fails instead). ``GCACHE_UI_SCREENSHOT=PATH``
saves the screenshot there (``docs/cluster-page.png`` is made so) after a longer load.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from gcache.discovery import MasterClient
from gcache.sdk import Client
from gcache.testing.cluster import Cluster
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration]

TOKEN = "cluster-page-token"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOT = os.environ.get("GCACHE_UI_SCREENSHOT", "")

# what the page shows, read in one script call
_PAGE_STATE = """
const $ = (id) => document.getElementById(id);
return {
  polls: Number($('updated').dataset.polls || 0),
  error: $('error').checkVisibility() ? $('error').textContent : '',
  login: $('login').checkVisibility(),
  table: $('members').checkVisibility(),
  hash: location.hash,
  summary: $('summary').textContent,
  rows: [...document.querySelectorAll('#members tbody tr')].map((tr) => {
    const row = {id: tr.dataset.member};
    for (const td of tr.cells) row[td.dataset.field] = {text: td.textContent,
      value: td.dataset.value === undefined ? null : Number(td.dataset.value)};
    return row;
  }),
  points: Object.fromEntries([...document.querySelectorAll('svg[data-series]')].map(
    (s) => [s.dataset.member + '/' + s.dataset.series,
            [Number(s.dataset.points), s.querySelector('polyline')?.getAttribute('points') || '']])),
};
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(3, "32MiB", slab="1MiB", masters=1, token=TOKEN,
                 prefix=f"cache-{uuid.uuid4().hex[:4]}",
                 log_dir=str(tmp_path_factory.mktemp("logs"))) as cl:
        yield cl


def _get(address: str, path: str, token: str = "") -> tuple[int, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_page_files_need_no_token_reveal_nothing_and_no_other_name_is_served(cluster) -> None:
    master = cluster.master_addresses[0]
    for path, ctype in (("/ui", "text/html"), ("/ui/", "text/html"),
                        ("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        code, headers, body = _get(master, path)
        assert code == 200 and headers["content-type"].startswith(ctype), (path, code)
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        for s in cluster.servers:  # static: no member, address or epoch in it
            assert s.name.encode() not in body and s.address.encode() not in body
    assert _get(master, "/status")[0] == 401  # the data stays behind the credential
    for path in ("/ui/../api.py", "/ui/%2e%2e/api.py", "/ui/page/app.js", "/ui/index.html",
                 "/ui//app.js", "/ui/app.js/", "/ui/cluster_page.py", "/page/app.js",
                 "/ui/../../etc/passwd"):
        assert _get(master, path)[0] == 401, path  # no credential: not served
        code, _, body = _get(master, path, TOKEN)
        assert code == 404 and b"import" not in body and b"root:" not in body, path


def _browser(tmp: Path):
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        if os.environ.get("GCACHE_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} or {CHROMEDRIVER} is missing and GCACHE_REQUIRE_BROWSER "
                        "is set: run `make venv` as root, or apt-get install chromium "
                        "chromium-driver")
        pytest.skip("no chromium / chromedriver (apt-get install chromium chromium-driver; "
                    "GCACHE_REQUIRE_BROWSER=1 makes this a failure)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-extensions",
                "--window-size=1200,860", "--hide-scrollbars", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # its profile and its singleton socket directory (which chromium puts in TMPDIR and
    # leaves behind) go in a directory the test removes
    opts.add_argument(f"--user-data-dir={tmp / 'profile'}")
    # the driver's path given: Selenium Manager (which would download one) is not run
    return webdriver.Chrome(options=opts, service=Service(
        CHROMEDRIVER, env={**os.environ, "TMPDIR": str(tmp)}))


def _quit(driver) -> None:
    """Quit the browser, and check that chromedriver and every chromium process it
    started are gone (killing any that are not, then failing)."""
    import psutil

    try:
        procs = [psutil.Process(driver.service.process.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    driver.quit()
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        p.kill()
    assert not alive, f"browser processes left after quit: {alive}"


class _Load:
    """A client putting and getting in a thread: 3 of 4 reads hit, so every server
    shows a hit rate strictly between 0 and 1."""

    def __init__(self, masters: list[str]) -> None:
        self.client = Client(masters=masters, token=TOKEN)
        self.stop = threading.Event()
        self.rounds = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        value = b"x" * (64 << 10)
        while not self.stop.is_set():
            r = self.rounds
            keys = [f"page-{r % 50}-{i}".encode() for i in range(48)]
            self.client.put_batch(keys, [value] * len(keys))
            self.client.get_batch(keys + [f"absent-{r}-{i}".encode() for i in range(16)])
            self.rounds += 1
            time.sleep(0.02 if self.rounds % 40 < 20 else 0.1)  # vary the rates

    def __enter__(self) -> "_Load":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.client.close()


@pytest.mark.timeout(90)
def test_page_in_chromium_lists_members_and_numbers_move_under_load(cluster, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    master = cluster.master_addresses[0]
    names = sorted(s.name for s in cluster.servers)
    # chromium's singleton socket lives in TMPDIR and its path must fit a unix socket
    # address (108 bytes): a short directory of our own, not the xdist worker's tmp_path
    scratch = Path(tempfile.mkdtemp(prefix="gcache-chromium-"))
    try:
        driver = _browser(scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        def state() -> dict:
            return driver.execute_script(_PAGE_STATE)

        driver.set_script_timeout(5)
        driver.get(f"http://{master}/ui#token=wrong-token&every=0.5")
        st = wait_for(lambda: (s := state())["error"] and s, 10)
        assert "401" in st["error"] and st["login"], st  # the master's refusal, then the form
        assert st["hash"] == "#every=0.5", st  # the credential left the address bar
        assert driver.execute_script("return sessionStorage.length") == 0  # forgotten

        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        st = wait_for(lambda: (s := state())["rows"] and s, 10)
        assert sorted(r["id"] for r in st["rows"]) == names, st
        assert not st["error"] and not st["login"] and st["table"], st  # the form is gone
        assert "epoch" in st["summary"] and "3 up" in st["summary"], st
        for r in st["rows"]:
            assert r["state"]["text"].startswith("up"), r
            assert re.fullmatch(r"[0-9.]+ (B|KiB|MiB) / 3[12](\.0)? MiB", r["memory"]["text"]), r

        with _Load(cluster.master_addresses) as load:
            def busy() -> dict:  # every server's heartbeat carries traffic now
                s = state()
                return s if len(s["rows"]) == 3 and all(
                    (r["ops"]["value"] or 0) > 0 and 0 < (r["hit"]["value"] or 0) < 1
                    and (r["bytes"]["value"] or 0) > 0 and (r["p99"]["value"] or 0) > 0
                    for r in s["rows"]) else None

            first = wait_for(busy, 20)
            ops_seen = {r["id"]: {r["ops"]["value"]} for r in first["rows"]}

            def moved() -> dict | None:  # the numbers change and the charts grow
                s = state()
                for r in s["rows"]:
                    ops_seen[r["id"]].add(r["ops"]["value"])
                grown = all(s["points"][k][0] >= first["points"][k][0] + 3
                            for k in first["points"])
                return s if grown and all(len(v) > 2 for v in ops_seen.values()) else None

            last = wait_for(moved, 20, step=0.25)
            if SCREENSHOT:  # a longer load for the picture in the docs
                time.sleep(40)
            drained = names[-1]  # a state change shows at the next poll
            MasterClient(master, TOKEN, timeout_s=3.0).admin("drain", drained)
            st = wait_for(lambda: (s := state())["rows"] and "draining" in next(
                r for r in s["rows"] if r["id"] == drained)["state"]["text"] and s, 10)
            assert "2 up, 1 draining" in st["summary"], st
            if SCREENSHOT:
                time.sleep(5)
                driver.set_window_size(1200, 700)
            shot = SCREENSHOT or str(tmp_path / "cluster-page.png")
            assert driver.save_screenshot(shot)
            assert load.rounds > 0
        assert last["polls"] > first["polls"]
        for name in names:
            for series in ("hit", "bps", "p99"):
                n, line = last["points"][f"{name}/{series}"]
                assert n > 3 and len(line.split()) == n, (name, series, n, line)
        assert "%" in last["rows"][0]["hit"]["text"] and "B/s" in last["rows"][0]["bytes"]["text"]
        with open(shot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        problems = [e["message"] for e in driver.get_log("browser")
                    if e["level"] == "SEVERE" and "/status" not in e["message"]]
        assert not problems, problems  # no CSP violation, no script error
    finally:
        try:
            _quit(driver)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
