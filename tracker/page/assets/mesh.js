// The live mesh page: polls /api/mesh and redraws. Every string from the
// tracker goes into the page through textContent (never innerHTML): peer
// ids and backend names come from registrants and are untrusted.
"use strict";

const seen = new Map(); // peer id -> last row data, to mark departed nodes "gone"
let refreshMs = 2000;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function num(v, digits) {
  return typeof v === "number" && isFinite(v) ? v.toFixed(digits) : "—";
}

function age(iso, now) {
  const t = Date.parse(iso);
  if (!isFinite(t)) return "—";
  return Math.max(0, (now - t) / 1000).toFixed(1) + " s ago";
}

// variantName is a variant's label and the start of its fingerprint
// ("bf16 3f9a2c1d"); nodes that sent none are "—".
function variantName(v) {
  if (!v || !v.fingerprint) return "—";
  return (v.label ? v.label + " " : "") + v.fingerprint.slice(0, 8);
}

function renderModels(models) {
  const box = document.getElementById("models");
  box.replaceChildren();
  if (models.length === 0) box.append(el("p", "No live node is registered."));
  for (const m of models) {
    const div = el("div", null, "model");
    const h = el("h3");
    h.append(el("span", m.model, "model-name mono"), el("span", " · " + m.num_layers + " layers · "),
      el("span", m.covered ? "covered" : "not covered", m.covered ? "ok" : "bad"));
    div.append(h);
    // A route runs on one variant: say which ones cover every layer.
    const vs = m.variants || [];
    if (vs.length > 1 || (vs.length === 1 && vs[0].fingerprint)) {
      const ul = el("ul", null, "variants");
      for (const v of vs) {
        const li = el("li");
        li.append(el("span", variantName(v), "variant mono"), el("span", " · " + v.nodes + (v.nodes === 1 ? " node · " : " nodes · ")),
          el("span", v.covered ? "covered" : "not covered", v.covered ? "ok" : "bad"));
        ul.append(li);
      }
      div.append(ul);
    }
    const t = el("table", null, "coverage");
    const head = el("tr");
    for (const c of ["layer", "replicas", "throughput (layers/s)", ""]) head.append(el("th", c));
    t.append(head);
    const maxT = Math.max(1, ...m.layers.map(l => l.throughput || 0));
    for (const l of m.layers) {
      const tr = el("tr");
      tr.append(el("td", l.layer, "num"), el("td", l.replicas, "num"), el("td", num(l.throughput, 1), "num"));
      const bar = el("span", null, l.replicas > 0 ? "bar" : "bar zero");
      if (l.replicas > 0) bar.style.width = (120 * (l.throughput || 0) / maxT).toFixed(0) + "px";
      const td = el("td");
      td.append(bar);
      tr.append(td);
      t.append(tr);
    }
    div.append(t);
    box.append(div);
  }
}

function renderNodes(nodes, now) {
  const live = new Set();
  for (const n of nodes) {
    live.add(n.peer_id);
    seen.set(n.peer_id, n);
  }
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren();
  const ids = [...seen.keys()].sort();
  for (const id of ids) {
    const n = seen.get(id);
    const gone = !live.has(id);
    const tr = el("tr", null, gone ? "gone" : "");
    tr.dataset.peer = id;
    const health = gone ? "gone" : n.health;
    tr.append(
      el("td", n.peer_id, "mono peer"),
      el("td", n.model, "mono"),
      el("td", variantName(n.variant), "mono variant"),
      el("td", n.layers[0] + "–" + n.layers[1], "layers"),
      el("td", n.backend, "backend"),
      el("td", num(n.tokens_per_sec, 2), "num"),
      el("td", num(n.rpm1, 0), "num"),
      el("td", n.sessions, "num"),
      el("td", health, "health " + (health === "ok" ? "ok" : "bad")),
      el("td", n.audit ? n.audit + (n.dispute ? " with " + n.dispute.with.slice(0, 12) + ": " + n.dispute.served + " served on both, " + n.dispute.refused + " refused" : "") : "—", "audit"),
      el("td", gone ? "—" : age(n.last_heartbeat, now)));
    body.append(tr);
  }
}

function renderTrackers(trackers) {
  const ul = document.getElementById("trackers");
  ul.replaceChildren();
  for (const t of trackers) {
    const li = el("li");
    li.append(el("span", t.peer_id, "mono"), el("span", " "), el("span", t.url || "", "mono"));
    ul.append(li);
  }
}

// liveCount says how many nodes are live: the first page of them is shown
// (/api/mesh pages its nodes; nodes_total counts all).
function liveCount(m) {
  const shown = (m.nodes || []).length;
  const total = typeof m.nodes_total === "number" ? m.nodes_total : shown;
  return total > shown ? total + " (" + shown + " shown)" : String(total);
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("/api/mesh", { cache: "no-store" });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const m = await resp.json();
    refreshMs = m.refresh_ms > 0 ? m.refresh_ms : refreshMs;
    const now = Date.parse(m.now) || Date.now();
    renderModels(m.models || []);
    renderNodes(m.nodes || [], now);
    renderTrackers(m.trackers || []);
    status.textContent = liveCount(m) + " live nodes · updated " + new Date(now).toLocaleTimeString() +
      " · every " + (refreshMs / 1000) + " s";
    status.className = "";
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (e) {
    status.textContent = "tracker not answering (" + e.message + "); retrying";
    status.className = "bad";
  }
  setTimeout(refresh, refreshMs);
}

refresh();
