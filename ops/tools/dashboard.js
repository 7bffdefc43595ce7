// The dashboard page: reads /api/state every second and draws it. Every value from the run
// is put in the page as text (textContent, SVG attributes), never parsed as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
                "#17becf", "#7f7f7f", "#bcbd22"];
const EVENT_COLORS = {join: "#2ca02c", rejoin: "#2ca02c", back: "#2ca02c", down: "#d62728",
                      fault: "#d62728", "dead-letter": "#b3261e", dropped: "#ff7f0e",
                      clipped: "#ff7f0e", outvoted: "#ff7f0e", "round-refused": "#ff7f0e",
                      rebalance: "#9467bd", recovered: "#9467bd", done: "#1f77b4"};

// a bearer token given as #token=… is kept for this tab and taken out of the address bar
let token = sessionStorage.getItem("diloco-token");
if (location.hash.startsWith("#token=")) {
  try {
    token = decodeURIComponent(location.hash.slice(7));
    sessionStorage.setItem("diloco-token", token);
  } catch (e) {
    token = null;
  }
  history.replaceState(null, "", location.pathname);
}

function colorOf(kind) {
  return Object.hasOwn(EVENT_COLORS, kind) ? EVENT_COLORS[kind] : "#7f7f7f";
}

// min and max of many numbers (spreading a long array into Math.min overflows the stack)
function range(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) {
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  return [lo, hi];
}

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
                                   : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function num(v, digits) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  return Number(v).toLocaleString(undefined, {maximumFractionDigits: digits ?? 0});
}

function ago(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  return s < 120 ? `${s.toFixed(0)} s ago` : `${(s / 60).toFixed(0)} min ago`;
}

function bytes(n) {
  if (!isFinite(n)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function fillTable(id, rows, cells, key) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const row of rows) {
    const tr = el("tr");
    if (key) for (const [k, v] of Object.entries(key(row))) tr.dataset[k] = v;
    for (const c of cells(row)) {
      const td = el("td", {}, null);
      if (c instanceof Node) td.append(c); else { td.textContent = c; td.title = c; }
      if (typeof c === "string" && /^[–\d,.\s-]+$/.test(c)) td.className = "num";
      tr.append(td);
    }
    body.append(tr);
  }
}

// one line chart: series = [{name, points: [[x, y], …]}]
function chart(id, series, xlabel, xfmt) {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  const w = svg.clientWidth || 500, h = svg.clientHeight || 220;
  const m = {l: 48, r: 10, t: 8, b: 28};
  const pts = series.flatMap(s => s.points);
  if (!pts.length) {
    svg.append(el("svg:text", {x: m.l, y: h / 2}, "no data yet"));
    return;
  }
  let [x0, x1] = range(pts.map(p => p[0]));
  let [y0, y1] = range(pts.map(p => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const X = x => m.l + (x - x0) / (x1 - x0) * (w - m.l - m.r);
  const Y = y => h - m.b - (y - y0) / (y1 - y0) * (h - m.t - m.b);
  svg.append(el("svg:line", {x1: m.l, y1: h - m.b, x2: w - m.r, y2: h - m.b, stroke: "#ccd"}));
  svg.append(el("svg:line", {x1: m.l, y1: m.t, x2: m.l, y2: h - m.b, stroke: "#ccd"}));
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    svg.append(el("svg:text", {x: 4, y: Y(y) + 4}, y.toPrecision(3)));
  }
  svg.append(el("svg:text", {x: m.l, y: h - 8}, xfmt(x0)));
  svg.append(el("svg:text", {x: w - m.r, y: h - 8, "text-anchor": "end"}, xfmt(x1)));
  svg.append(el("svg:text", {x: (w + m.l) / 2, y: h - 8, "text-anchor": "middle"}, xlabel));
  series.forEach((s, i) => {
    const line = el("svg:polyline", {
      fill: "none", stroke: s.color || COLORS[i % COLORS.length], "stroke-width": 1.6,
      points: s.points.map(p => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" "),
      "data-series": s.name, "data-points": s.points.length});
    svg.append(line);
  });
}

function legend(id, series) {
  const box = document.getElementById(id);
  box.replaceChildren();
  series.forEach((s, i) => {
    const item = el("span");
    item.append(el("i", {style: `background:${s.color || COLORS[i % COLORS.length]}`}));
    item.append(document.createTextNode(s.name));
    box.append(item);
  });
}

function detail(d) {
  return Object.entries(d || {}).map(([k, v]) => `${k}=${v}`).join(" ");
}

function timeline(events, t0, t1) {
  const svg = document.getElementById("timeline");
  svg.replaceChildren();
  const w = svg.clientWidth || 1000, h = svg.clientHeight || 60;
  if (!events.length) return;
  if (t1 <= t0) t1 = t0 + 1;
  const X = t => 10 + (t - t0) / (t1 - t0) * (w - 20);
  svg.append(el("svg:line", {x1: 10, y1: h / 2, x2: w - 10, y2: h / 2, stroke: "#ccd"}));
  for (const e of events) {
    const mark = el("svg:circle", {cx: X(e.t).toFixed(1), cy: h / 2, r: 5,
                                   fill: colorOf(e.kind),
                                   "data-kind": e.kind});
    mark.append(el("svg:title", {}, `${clock(e.t)} ${e.kind} ${detail(e.detail)}`));
    svg.append(mark);
  }
  svg.append(el("svg:text", {x: 10, y: h - 2}, clock(t0)));
  svg.append(el("svg:text", {x: w - 10, y: h - 2, "text-anchor": "end"}, clock(t1)));
}

function draw(s) {
  document.getElementById("run").textContent = s.run;
  document.getElementById("mode").textContent = s.mode ?? "–";
  const live = s.learners.filter(l => l.state === "live").length;
  document.getElementById("live").textContent = `${live} live / ${s.learners_expected}`;
  document.getElementById("rounds").textContent = num(s.rounds);
  document.getElementById("goodput").textContent =
    s.goodput === null ? "– (until every learner joined)" : s.goodput.toFixed(3);
  document.getElementById("up").textContent = bytes(s.bytes_up);
  document.getElementById("down").textContent = bytes(s.bytes_down);
  document.getElementById("updated").textContent =
    `read ${clock(s.now)}${s.done ? " · run finished" : ""}`;
  const err = document.getElementById("error");
  err.style.display = s.error ? "block" : "none";
  err.textContent = s.error ? `Redis could not be read: ${s.error} (showing the last read)` : "";

  fillTable("learners", s.learners, l => {
    const badge = el("span", {class: `state ${l.state}`}, l.state);
    return [l.id, badge, num(l.step), num(l.tokens_per_s), num(l.loss, 3), ago(l.last_push_s),
            num(l.staleness), l.host || "–"];
  }, l => ({learner: l.id, state: l.state}));
  fillTable("syncers", s.syncers, y => [y.id, y.fragments.join(" "), num(y.rounds),
            num(y.rounds_per_s, 2), num(y.lag), y.leases.join(" ") || "–", y.host || "–",
            y.last_reason || "–"], y => ({syncer: y.id}));
  fillTable("fragments", s.fragments, f => [String(f.fragment), num(f.version),
            num(f.last_size), f.last_reason || "–", num(f.lag), num(f.dead_letters),
            f.lease || "–"], f => ({fragment: f.fragment}));

  const t0 = Math.min(s.now, range(Object.values(s.loss).flatMap(c => c.map(p => p[0])))[0],
                      range(s.events.map(e => e.t))[0], range(s.bytes.map(p => p[0]))[0]);
  const rel = t => `${(t - t0).toFixed(0)} s`;
  const lossSeries = Object.entries(s.loss).map(([name, c]) => ({
    name, points: c.map(p => [p[0], p[2]])}));
  chart("loss", lossSeries, "time", rel);
  legend("loss-legend", lossSeries);
  chart("eval", [{name: "eval", points: s.eval.map(p => [p[1], p[2]])}], "tokens",
        x => num(x));
  document.getElementById("eval-note").textContent = s.eval.length ? "" : s.run_dir ?
    "no evaluation records in the run folder yet" :
    "evaluated by `diloco run`'s launcher: start the dashboard with --run-dir of its folder";
  const byteSeries = [
    {name: "up (learners → Redis)", color: "#1f77b4", points: s.bytes.map(p => [p[0], p[1]])},
    {name: "down (merged values)", color: "#ff7f0e", points: s.bytes.map(p => [p[0], p[2]])}];
  chart("bytes", byteSeries, "time", rel);
  legend("bytes-legend", byteSeries);
  timeline(s.events, t0, s.now);
  fillTable("events", s.events.slice().reverse(), e => [clock(e.t), e.kind, detail(e.detail)],
            e => ({kind: e.kind}));
  document.querySelectorAll("#events tbody td:nth-child(2)").forEach(td => {
    td.className = "kind";
    td.style.color = colorOf(td.textContent);
  });
  document.body.dataset.updated = String(s.now);
}

async function tick() {
  try {
    const r = await fetch("api/state", {
      headers: token ? {Authorization: `Bearer ${token}`} : {}, cache: "no-store"});
    if (r.status === 401) {
      const err = document.getElementById("error");
      err.style.display = "block";
      err.textContent = "this dashboard needs its token: open it as …/#token=<token>";
    } else if (r.ok) {
      const state = await r.json();
      try {
        draw(state);
      } catch (e) {
        const err = document.getElementById("error");
        err.style.display = "block";
        err.textContent = `the page could not draw the run's state: ${e}`;
      }
    }
  } catch (e) {
    const err = document.getElementById("error");
    err.style.display = "block";
    err.textContent = `the dashboard server could not be reached: ${e}`;
  }
  setTimeout(tick, 1000);
}
tick();
