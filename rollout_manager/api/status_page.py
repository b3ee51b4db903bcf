"""The live status page served at ``GET /``: one self-contained HTML document (inline CSS and JS).

The page polls ``get_instances_status`` every second (and ``metrics`` every few seconds for the
measured per-instance token rates) and renders instances, counts by state, the weight version, the
local window and budget, generation counters, recent weight pushes and recent lifecycle events. It
loads nothing from anywhere else. With ``auth_token`` set on the manager, open ``/#token=<token>``:
the page keeps the token in the tab's session storage and sends it as a bearer token.
"""

from __future__ import annotations

from aiohttp import web

# Inline script and style only; nothing may be fetched from another origin.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")

STATUS_PAGE_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rollout-manager</title>
<style>
  :root { --bg:#f6f7f9; --card:#fff; --fg:#1d2330; --muted:#667085; --line:#e3e6eb; --accent:#2f6fde;
          --active:#1a7f37; --pending:#9a6700; --syncing:#2f6fde; --draining:#8250df; --dead:#cf222e;
          --local:#0e7490; --remote:#475467; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
         background:var(--bg); color:var(--fg); }
  header { display:flex; align-items:center; gap:16px; padding:12px 20px; background:#1d2330; color:#fff; }
  header h1 { font-size:18px; margin:0; font-weight:600; }
  header .sub { color:#b8c0cc; font-size:13px; }
  header .right { margin-left:auto; text-align:right; font-size:13px; color:#b8c0cc; }
  #live { display:inline-block; width:9px; height:9px; border-radius:50%; background:#888; margin-right:6px; }
  #live.ok { background:#3fb950; } #live.bad { background:#f85149; }
  #banner { display:none; margin:12px 20px 0; padding:10px 14px; border-radius:6px; background:#ffebe9;
            border:1px solid #ff8182; color:#82071e; font-weight:600; }
  #banner.show { display:block; }
  main { padding:12px 20px 24px; }
  main.stale { opacity:.55; }
  .cards { display:grid; grid-template-columns:repeat(auto-fit, minmax(170px, 1fr)); gap:10px; margin-bottom:12px; }
  .card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 12px; }
  .card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
  .card .v { font-size:22px; font-weight:600; margin-top:2px; font-variant-numeric:tabular-nums; }
  .card .s { color:var(--muted); font-size:12px; margin-top:2px; }
  section { background:var(--card); border:1px solid var(--line); border-radius:8px; margin-bottom:12px; overflow:hidden; }
  .scroll { overflow-x:auto; }
  section h2 { font-size:14px; margin:0; padding:8px 12px; border-bottom:1px solid var(--line); background:#fafbfc; }
  section h2 .n { color:var(--muted); font-weight:400; }
  table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
  th, td { text-align:left; padding:5px 10px; border-bottom:1px solid var(--line); white-space:nowrap; }
  th { color:var(--muted); font-weight:500; font-size:12px; }
  td.num, th.num { text-align:right; }
  td.wrap { white-space:normal; max-width:520px; overflow-wrap:anywhere; }
  tr:last-child td { border-bottom:none; }
  .empty { color:var(--muted); padding:10px 12px; }
  .badge { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px; font-weight:600; color:#fff; }
  .st-active { background:var(--active); } .st-pending { background:var(--pending); }
  .st-syncing { background:var(--syncing); } .st-draining { background:var(--draining); }
  .st-dead { background:var(--dead); }
  .kind-local { color:var(--local); font-weight:600; } .kind-remote { color:var(--remote); }
  .lag { color:var(--dead); font-weight:600; }
  .muted { color:var(--muted); }
  .pills { display:flex; flex-wrap:wrap; gap:4px 10px; margin-top:4px; }
  .pills b { font-variant-numeric:tabular-nums; }
  .cols { display:grid; grid-template-columns:1fr 1fr; gap:12px; }
  @media (max-width: 1100px) { .cols { grid-template-columns:1fr; } }
</style>
</head>
<body>
<header>
  <h1>rollout-manager</h1>
  <span class="sub" id="service"></span>
  <div class="right"><span id="live"></span><span id="updated">waiting for the first update&hellip;</span></div>
</header>
<div id="banner" role="alert"></div>
<main id="main">
  <div class="cards">
    <div class="card"><div class="k">Weight version</div><div class="v" id="c-version">&ndash;</div>
      <div class="s" id="c-version-s"></div></div>
    <div class="card"><div class="k">Instances</div><div class="v" id="c-instances">&ndash;</div>
      <div class="s pills" id="c-counts"></div></div>
    <div class="card"><div class="k">Tokens/s</div><div class="v" id="c-tps">&ndash;</div>
      <div class="s" id="c-tps-s">finished sequences, last 10 s</div></div>
    <div class="card"><div class="k">Generation</div><div class="v" id="c-seqs">&ndash;</div>
      <div class="s" id="c-gen"></div></div>
    <div class="card"><div class="k">Local window</div><div class="v" id="c-local">&ndash;</div>
      <div class="s" id="c-local-s"></div></div>
  </div>
  <section>
    <h2>Instances <span class="n" id="n-instances"></span></h2>
    <div class="scroll"><table><thead><tr><th>endpoint</th><th>id</th><th>kind</th><th>state</th><th class="num">for</th>
      <th class="num">weights</th><th class="num">in flight</th><th class="num">tokens reserved</th>
      <th class="num" title="tokens/s while busy, measured by the manager from the instance's streams">tok/s busy</th>
      <th>sender / group</th><th class="num">failures</th><th>last error</th></tr></thead>
      <tbody id="instances"></tbody></table></div>
    <div class="empty" id="instances-empty">no instances registered</div>
  </section>
  <div class="cols">
    <section>
      <h2>Recent weight pushes <span class="n" id="n-pushes"></span></h2>
      <div class="scroll"><table><thead><tr><th>time</th><th>endpoint</th><th class="num">version</th>
        <th>sender / group (ip)</th><th class="num">MB</th><th class="num">GB/s</th><th class="num">total s</th></tr></thead>
        <tbody id="pushes"></tbody></table></div>
      <div class="empty" id="pushes-empty">no weight pushes yet</div>
    </section>
    <section>
      <h2>Recent events <span class="n" id="n-events"></span></h2>
      <div class="scroll"><table><thead><tr><th>time</th><th>endpoint</th><th>transition</th><th>reason</th></tr></thead>
        <tbody id="events"></tbody></table></div>
      <div class="empty" id="events-empty">no events yet</div>
    </section>
  </div>
</main>
<script>
(function () {
  "use strict";
  var POLL_MS = 1000, METRICS_MS = 3000;
  var m = /(?:^|[#&])token=([^&]+)/.exec(location.hash || "");
  if (m) { try { sessionStorage.setItem("rm-token", decodeURIComponent(m[1])); } catch (e) {}
           history.replaceState(null, "", location.pathname + location.search); }
  var token = null; try { token = sessionStorage.getItem("rm-token"); } catch (e) {}
  var headers = token ? { "Authorization": "Bearer " + token } : {};
  var samples = [], rates = {}, lastOk = null, lastMetrics = 0;

  function $(id) { return document.getElementById(id); }
  function el(tag, text, cls) { var e = document.createElement(tag); if (text !== undefined && text !== null) e.textContent = String(text); if (cls) e.className = cls; return e; }
  function row(cells) { var tr = document.createElement("tr"); cells.forEach(function (c) { tr.appendChild(c); }); return tr; }
  function num(v, cls) { return el("td", v, "num" + (cls ? " " + cls : "")); }
  function fill(id, rows) { var tb = $(id); tb.replaceChildren.apply(tb, rows); $(id + "-empty").style.display = rows.length ? "none" : "block"; }
  function clock(t) { var d = t ? new Date(t * 1000) : new Date(); return d.toLocaleTimeString([], { hour12: false }); }
  function dur(s) { if (s === null || s === undefined) return ""; if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + "s";
                    if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
                    return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m"; }
  function fmt(v, d) { return (v === null || v === undefined || isNaN(v)) ? "\u2013" : Number(v).toFixed(d); }
  function badge(state) { return el("span", state, "badge st-" + state); }

  function render(st) {
    var counts = st.counts || {}, instances = st.instances || [], gen = st.generation || {}, local = st.local || {};
    $("c-version").textContent = "v" + st.weight_version;
    var behind = instances.filter(function (i) { return i.kind === "remote" && i.weight_version < st.weight_version; }).length;
    var senders = (st.weight_senders && st.weight_senders.senders) || [];
    var groups = senders.reduce(function (n, x) { return n + x.groups.length; }, 0);
    $("c-version-s").textContent = (behind ? behind + " instance(s) behind" : "every instance current") + " \u00b7 " +
      (senders.length ? senders.length + " sender(s), " + groups + " group(s)" : "no weight sender yet");
    $("c-instances").textContent = instances.length;
    var pills = Object.keys(counts).map(function (k) { var s = el("span"); s.appendChild(badge(k)); s.appendChild(document.createTextNode(" ")); s.appendChild(el("b", counts[k])); return s; });
    $("c-counts").replaceChildren.apply($("c-counts"), pills);
    $("c-seqs").textContent = (gen.sequences || 0) + " seq";
    $("c-gen").textContent = (gen.tokens || 0) + " tokens \u00b7 " + (gen.continuations || 0) + " continued \u00b7 " +
      (gen.failed || 0) + " failed \u00b7 " + (gen.preempted || 0) + " preempted";
    var now = Date.now() / 1000;
    samples.push([now, gen.tokens || 0]);
    while (samples.length > 2 && now - samples[1][0] >= 10) samples.shift();
    var first = samples[0], dt = now - first[0];
    $("c-tps").textContent = dt > 0.5 ? fmt(Math.max(0, ((gen.tokens || 0) - first[1]) / dt), 1) : "\u2013";
    $("c-local").textContent = local.open ? "open" : "closed";
    $("c-local-s").textContent = "budget " + fmt(local.budget_s, 2) + "s" + (local.last_close_reason ? " \u00b7 last closed: " + local.last_close_reason : "");

    $("n-instances").textContent = "(" + (st.ready_instances || 0) + " ready, " + (st.pending_instances || 0) + " pending)";
    fill("instances", instances.map(function (i) {
      var lag = st.weight_version - i.weight_version;
      var wv = el("td", "v" + i.weight_version + (lag > 0 ? " (\u2212" + lag + ")" : ""), "num" + (lag > 0 && i.kind === "remote" ? " lag" : ""));
      var state = el("td"); state.appendChild(badge(i.state));
      var sg = i.sender === null || i.sender === undefined ? "\u2013" : i.sender + " / " + i.group;
      return row([el("td", i.endpoint), el("td", i.id, "muted"), el("td", i.kind, "kind-" + i.kind), state,
                  num(dur(i.state_for_s), "muted"), wv, num(i.in_flight), num(i.in_flight_tokens),
                  num(fmt(rates[i.endpoint], 1)), el("td", sg), num(i.consecutive_failures),
                  el("td", i.last_error || "", "wrap muted")]);
    }));

    var pushes = (st.recent_weight_pushes || []).slice().reverse();
    $("n-pushes").textContent = pushes.length ? "(" + pushes.length + ")" : "";
    fill("pushes", pushes.map(function (p) {
      return row([el("td", clock(p.at), "muted"), el("td", p.endpoint), num("v" + p.version),
                  el("td", p.sender + " / " + p.group + " (" + p.ip + ")"), num(fmt(p.bytes / 1e6, 1)),
                  num(fmt(p.gbps, 2)), num(fmt(p.total_s, 2))]);
    }));

    var events = (st.recent_events || []).slice().reverse();
    $("n-events").textContent = events.length ? "(" + events.length + ")" : "";
    fill("events", events.map(function (e) {
      var tr = el("td"); if (e.from) { tr.appendChild(badge(e.from)); tr.appendChild(document.createTextNode(" \u2192 ")); } else { tr.appendChild(document.createTextNode("new \u2192 ")); }
      tr.appendChild(badge(e.to));
      return row([el("td", clock(e.at), "muted"), el("td", e.endpoint), tr, el("td", e.reason, "wrap")]);
    }));
  }

  function setError(msg) {
    var b = $("banner");
    if (msg) {
      b.textContent = msg + (lastOk ? " \u2014 showing data from " + lastOk.toLocaleTimeString([], { hour12: false }) : "");
      b.className = "show"; $("live").className = "bad"; $("main").className = lastOk ? "stale" : "";
    } else { b.className = ""; b.textContent = ""; $("live").className = "ok"; $("main").className = ""; }
  }

  function parseRates(text) {
    var out = {}, re = /^rollout_manager_instance_token_rate\{[^}]*endpoint="((?:[^"\\]|\\.)*)"[^}]*\}\s+(\S+)/;
    text.split("\n").forEach(function (line) { var x = re.exec(line); if (x) out[x[1].replace(/\\(.)/g, "$1")] = parseFloat(x[2]); });
    return out;
  }

  function pollMetrics() {
    if (Date.now() - lastMetrics < METRICS_MS) return;
    lastMetrics = Date.now();
    fetch("metrics", { cache: "no-store", headers: headers })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (t) { if (t !== null) rates = parseRates(t); })
      .catch(function () {});
  }

  function poll() {
    pollMetrics();
    fetch("get_instances_status", { cache: "no-store", headers: headers })
      .then(function (r) {
        if (r.status === 401) throw new Error("HTTP 401: the manager wants its bearer token; open this page as /#token=<auth_token>");
        if (!r.ok) throw new Error("HTTP " + r.status + " from get_instances_status");
        return r.json();
      })
      .then(function (st) {
        render(st);
        lastOk = new Date();
        $("updated").textContent = "last updated " + lastOk.toLocaleTimeString([], { hour12: false });
        setError(null);
      })
      .catch(function (e) { setError("Cannot fetch the manager's status: " + (e && e.message ? e.message : e)); })
      .then(function () { setTimeout(poll, POLL_MS); });
  }

  fetch("health", { cache: "no-store" }).then(function (r) { return r.json(); })
    .then(function (h) { $("service").textContent = (h.service || "rollout-manager") + " " + (h.version || "") + " \u00b7 " + location.host; })
    .catch(function () {});
  poll();
})();
</script>
</body>
</html>
"""


def response() -> web.Response:
    """The page, with a policy that forbids loading anything from elsewhere."""
    return web.Response(text=STATUS_PAGE_HTML, content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"})
