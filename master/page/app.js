/* gcache cluster page, served by the master API at /ui (master/cluster_page.py).
 *
 * Every `every` seconds (2 by default; the URL fragment may say #every=1) it asks the
 * master for GET /status with the operator's credential, as `gcache status` does, and
 * draws:
 *  - a summary: epoch, leader, masters, members by state;
 *  - one table row per member: state (join ramp, heartbeat age), memory and disk used of
 *    capacity, objects, and what it served lately from its last heartbeat
 *    (server/recent.py): GET hit ratio, ops/s, bytes/s (GET + PUT) and frame p99;
 *  - per server, small SVG line charts of hit rate, bytes/s (GB/s at scale) and p99
 *    over the polls of the last WINDOW_S seconds (the x axis spans what was seen, at
 *    least a minute). The history lives here, in the tab: the API serves none.
 *
 * The credential comes from the fragment (#token=..., then cleared from the address
 * bar; a fragment is never sent to a server) or from the form, stays in this tab's
 * sessionStorage, and goes only to /status as `Authorization: Bearer ...`. A 401 or 403
 * forgets it and asks again with the master's reason. Whatever a server reported (ids,
 * addresses, states) is written with textContent only; the CSP allows no inline script.
 */
"use strict";
(() => {
  const KEY = "gcache.credential";
  const WINDOW_S = 600;
  const DEADLINE_MS = 5000;
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);
  const hash = new URLSearchParams(location.hash.slice(1));
  const every = Math.min(60, Math.max(0.5, Number(hash.get("every")) || 2));
  if (hash.has("token")) {
    sessionStorage.setItem(KEY, hash.get("token"));
    hash.delete("token");
    const rest = hash.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
  }
  const seen = new Map(); // member id -> [{t, hit, ops, bps, p99}], oldest first
  let timer = null;
  let polls = 0;

  // ------------------------------------------------------------------ formatting
  const num = (x) => (typeof x === "number" && isFinite(x) ? x : null);
  function scaled(x, base, units) {
    let i = 0;
    while (Math.abs(x) >= base && i < units.length - 1) { x /= base; i++; }
    return `${x >= 100 || i === 0 ? x.toFixed(0) : x.toPrecision(3)} ${units[i]}`;
  }
  const size = (n) => scaled(n, 1024, ["B", "KiB", "MiB", "GiB", "TiB"]);
  const bytesRate = (x) => scaled(x, 1000, ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"]);
  const count = (x) => (x >= 1e4 ? scaled(x, 1000, ["", "k", "M", "G"]).replace(" ", "")
                                 : x.toFixed(x > 0 && x < 10 ? 1 : 0));
  const pct = (x) => `${(100 * x).toFixed(1)}%`;
  const ms = (x) => (x < 1 ? `${(1000 * x).toFixed(0)} µs` : `${x.toPrecision(3)} ms`);
  const orDash = (fmt) => (x) => (x === null || x === undefined ? "-" : fmt(x));

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    return e;
  }

  // ------------------------------------------------------------------ what a member did
  function figures(m) {
    const s = m.stats || {};
    const get = num(s.recent_get_bytes_per_s), put = num(s.recent_put_bytes_per_s);
    return {hit: num(s.recent_hit_ratio), ops: num(s.recent_ops_per_s), p99: num(s.recent_p99_ms),
            bps: get === null && put === null ? null : (get || 0) + (put || 0)};
  }

  function cell(field, text, value) {
    const td = el("td", text);
    td.dataset.field = field;
    if (value !== null && value !== undefined) td.dataset.value = value;
    return td;
  }

  function usage(field, used, cap, degraded) {
    const td = cell(field, null, used);
    if (!cap) { td.textContent = "-"; return td; }
    const bar = el("div", null, "bar");
    const fill = el("div", null, degraded ? "fill bad" : "fill");
    fill.style.width = `${Math.min(100, (100 * (used || 0)) / cap).toFixed(1)}%`;
    bar.append(fill);
    td.append(bar, el("span", `${used === null || used === undefined ? "-" : size(used)} / ${size(cap)}`
                              + (degraded ? " degraded" : ""), degraded ? "bad" : ""));
    return td;
  }

  function row(m) {
    const s = m.stats || {}, f = figures(m);
    const tr = el("tr");
    tr.dataset.member = m.id;
    const who = cell("member", null);
    who.append(el("b", m.id), el("br"), el("span", m.address, "dim"));
    let label = String(m.state);
    if (m.state === "joining") label += ` ${pct(num(m.ramp) ?? 1).replace(".0", "")}`;
    if (m.state === "down" && m.drained) label += " (drained)";
    const state = cell("state", null);
    state.append(el("span", label, `state state-${m.state}`));
    const hb = num(m.last_heartbeat_s);
    if (hb !== null) state.append(el("br"), el("span", `${hb.toFixed(1)} s ago`, "dim"));
    if (s.self_drain) state.append(el("br"), el("span", `self-drained: ${s.self_drain}`, "bad"));
    tr.append(who, state,
      usage("memory", num(s.used_bytes), num(s.capacity_bytes) || num(m.capacity_bytes), false),
      usage("disk", num(s.disk_used_bytes), num(s.disk_capacity_bytes), !!s.disk_degraded),
      cell("objects", orDash((x) => x.toLocaleString("en"))(num(s.objects)), num(s.objects)),
      cell("hit", orDash(pct)(f.hit), f.hit), cell("ops", orDash(count)(f.ops), f.ops),
      cell("bytes", orDash(bytesRate)(f.bps), f.bps), cell("p99", orDash(ms)(f.p99), f.p99));
    return tr;
  }

  // ------------------------------------------------------------------ charts (inline SVG)
  const W = 200, H = 44, PAD = 2;
  const SERIES = [["hit", "hit rate", pct, 1], ["bps", "bytes/s", bytesRate, 0], ["p99", "p99", ms, 0]];

  function chart(id, key, label, fmt, fixedMax, now, span) {
    const pts = (seen.get(id) || []).filter((p) => p[key] !== null);
    const max = fixedMax || Math.max(...pts.map((p) => p[key]), 1e-12) * 1.15;
    const xy = pts.map((p) => [W * (1 - (now - p.t) / span), H - PAD - ((H - 2 * PAD) * p[key]) / max]);
    const line = xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
    const box = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img"});
    box.dataset.member = id;
    box.dataset.series = key;
    box.dataset.points = pts.length;
    box.append(svg("line", {x1: 0, y1: H - PAD, x2: W, y2: H - PAD, class: "axis"}));
    if (xy.length) {
      const area = `${xy[0][0].toFixed(1)},${H - PAD} ${line} ${xy[xy.length - 1][0].toFixed(1)},${H - PAD}`;
      box.append(svg("polygon", {points: area, class: "area"}), svg("polyline", {points: line, class: "line"}));
    }
    const cap = el("figcaption");
    cap.append(el("span", label), el("b", pts.length ? fmt(pts[pts.length - 1][key]) : "-"),
               el("span", pts.length && !fixedMax ? `max ${fmt(max / 1.15)}` : "", "dim"));
    const fig = el("figure");
    fig.append(cap, box);
    return fig;
  }

  function charts(m, now, span) {
    const card = el("section", null, "card");
    card.dataset.member = m.id;
    card.append(el("h3", m.id));
    for (const [key, label, fmt, fixedMax] of SERIES) card.append(chart(m.id, key, label, fmt, fixedMax, now, span));
    return card;
  }

  // ------------------------------------------------------------------ polling
  function render(doc) {
    const now = Date.now() / 1000;
    const members = Array.isArray(doc.members) ? doc.members : [];
    for (const id of [...seen.keys()]) if (!members.some((m) => m.id === id)) seen.delete(id);
    for (const m of members) {
      const pts = seen.get(m.id) || [];
      pts.push({t: now, ...figures(m)});
      while (pts.length && pts[0].t < now - WINDOW_S) pts.shift();
      seen.set(m.id, pts);
    }
    const oldest = Math.min(now, ...[...seen.values()].map((p) => p[0].t));
    const span = Math.min(WINDOW_S, Math.max(60, now - oldest));
    const states = {};
    for (const m of members) states[m.state] = (states[m.state] || 0) + 1;
    $("summary").textContent = `epoch ${doc.epoch} · leader ${doc.leader} · `
      + `${(doc.masters || []).length} masters · ${members.length} members (`
      + Object.entries(states).map(([s, n]) => `${n} ${s}`).join(", ") + ")";
    polls += 1;
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}, every ${every} s`;
    $("updated").dataset.polls = polls;
    $("window").textContent = (span / 60).toFixed(span < 600 ? 1 : 0);
    document.querySelector("#members tbody").replaceChildren(...members.map(row));
    $("charts").replaceChildren(...members.map((m) => charts(m, now, span)));
    $("cluster").hidden = false;
  }

  function showError(msg) {
    $("error").textContent = msg;
    $("error").hidden = !msg;
  }

  function ask(msg) {
    clearTimeout(timer);
    $("login").hidden = false;
    showError(msg);
    $("token").focus();
  }

  async function poll() {
    clearTimeout(timer);
    const cred = sessionStorage.getItem(KEY);
    if (!cred) return ask("");
    const ctl = new AbortController();
    const deadline = setTimeout(() => ctl.abort(), DEADLINE_MS);
    try {
      const r = await fetch("/status", {headers: {Authorization: `Bearer ${cred}`},
                                        cache: "no-store", signal: ctl.signal});
      const doc = await r.json().catch(() => ({}));
      if (r.status === 401 || r.status === 403) {
        sessionStorage.removeItem(KEY);
        return ask(`The master refused this credential (${r.status}): ${doc.error || r.statusText}`);
      }
      if (!r.ok) throw new Error(`${r.status}: ${doc.error || r.statusText}`);
      showError("");
      $("login").hidden = true;
      render(doc);
    } catch (e) {
      const why = e.name === "AbortError" ? `no answer within ${DEADLINE_MS / 1000} s` : e.message;
      showError(`/status failed: ${why}; retrying every ${every} s`);
    } finally {
      clearTimeout(deadline);
    }
    timer = setTimeout(poll, every * 1000);
  }

  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("token").value.trim());
    $("token").value = "";
    $("login").hidden = true;
    showError("");
    poll();
  });
  poll();
})();
