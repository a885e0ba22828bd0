// Tangram status page: asks for the bearer token, reads the server-sent snapshots of
// /v1/status/events (fetch, so the token travels as a header, never in a URL) and redraws.
// Every server string goes through textContent: action ids come from clients.
"use strict";

const TOKEN_KEY = "tangram-token";
let snap = null;        // last snapshot
let receivedAt = 0;     // performance.now() when it arrived (clocks advance locally)
let stream = null;      // AbortController of the open stream

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "data") Object.entries(v).forEach(([dk, dv]) => { if (dv != null) e.dataset[dk] = dv; });
    else if (k === "style") Object.assign(e.style, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// One colour per trajectory, given in order of first sight and spread by the golden angle,
// so trajectories seen one after the other always get far-apart hues (stable for the page).
const hues = new Map();
function hue(trajectory) {
  const key = String(trajectory);
  if (!hues.has(key)) hues.set(key, Math.round((hues.size * 137.508 + 210) % 360));
  return `hsl(${hues.get(key)}, 60%, 38%)`;
}

const secs = (s) => (s == null ? "" : s < 10 ? s.toFixed(2) : s.toFixed(1));
const elapsed = () => (performance.now() - receivedAt) / 1000;

// -- auth ---------------------------------------------------------------------------------
function showLogin(message = "") {
  if (stream) stream.abort();
  $("view").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  setConn(false, "not connected");
  $("token").focus();
}

$("login").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const token = $("token").value.trim();
  const res = await fetch("/v1/status", { headers: { Authorization: `Bearer ${token}` } });
  if (res.status === 401) return showLogin("That token is not this server's.");
  if (!res.ok) return showLogin(`The server answered ${res.status}.`);
  sessionStorage.setItem(TOKEN_KEY, token);
  $("token").value = "";
  start(token, await res.json());
});

$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showLogin();
});

function setConn(on, text) {
  $("conn").className = `conn ${on ? "on" : "off"}`;
  $("conn").textContent = text;
}

// -- the event stream ---------------------------------------------------------------------
function start(token, first) {
  $("login").hidden = true;
  $("view").hidden = false;
  $("logout").hidden = false;
  if (first) show(first);
  listen(token);
}

async function listen(token) {
  stream = new AbortController();
  try {
    const res = await fetch("/v1/status/events", {
      headers: { Authorization: `Bearer ${token}`, Accept: "text/event-stream" },
      signal: stream.signal,
    });
    if (res.status === 401) return showLogin("The server no longer accepts this token.");
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    setConn(true, "live");
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trim()).join("\n");
        if (data) show(JSON.parse(data));
      }
    }
    throw new Error("stream ended");
  } catch (err) {
    if (stream.signal.aborted) return;
    setConn(false, `reconnecting (${err.message})`);
    setTimeout(() => listen(token), 1000);
  }
}

// -- drawing ------------------------------------------------------------------------------
function show(s) {
  snap = s;
  receivedAt = performance.now();
  $("policy").textContent = `policy ${s.policy}`;
  const fin = Object.entries(s.totals.finished).map(([k, v]) => `${v} ${k}`).join(", ") || "none";
  $("totals").textContent = `${s.totals.running} running \u00b7 ${s.totals.queued} queued \u00b7 ` +
    `${s.totals.trajectories} trajectories \u00b7 finished: ${fin}`;
  drawNodes(s.nodes);
  drawQueues(s.queues);
  drawGpus(s.gpu_nodes);
  drawQuotas(s.quotas);
  drawImages(s.images);
  drawRecent(s.recent);
}

const mb = (b) => (b == null ? "" : (b / 1e6).toFixed(1));

function drawImages(im) {
  $("images-section").hidden = !im;
  if (!im) return;
  const box = $("images");
  box.replaceChildren();
  const c = im.counters;
  const budget = im.budget_bytes == null ? "no budget" : `budget ${mb(im.budget_bytes)} MB`;
  box.append(el("p", { id: "image-counters" },
    `${c.hits} hits \u00b7 ${c.misses} misses \u00b7 ${c.pulls} pulls (${mb(c.pulled_bytes)} MB, ` +
    `${c.pull_failures} failed, ${c.shared} shared) \u00b7 ${c.evictions} evicted \u00b7 ` +
    `cache ${mb(im.used_bytes)} MB of ${budget}` + (im.over_budget ? " (over: held images)" : "") +
    ` \u00b7 ${im.pulls_at_once} pulls at once`));
  const body = el("tbody");
  for (const p of im.pulling) {
    const pct = p.total_bytes ? Math.round((100 * p.downloaded_bytes) / p.total_bytes) : 0;
    body.append(el("tr", { class: "pull", data: { image: p.image, state: p.state } },
      el("td", {}, p.image), el("td", {}, p.state), el("td", {}, p.waiting),
      el("td", {}, `${mb(p.downloaded_bytes)} / ${mb(p.total_bytes)} MB (${pct}%)`),
      el("td", {}, secs(p.seconds))));
  }
  if (!im.pulling.length) body.append(el("tr", {}, el("td", { colspan: 5, class: "muted" }, "no pull in progress")));
  box.append(el("table", { id: "pulls" }, el("thead", {}, el("tr", {}, el("th", {}, "pulling"),
    el("th", {}, "state"), el("th", {}, "opens waiting"), el("th", {}, "downloaded"),
    el("th", {}, "for (s)"))), body));
  const cached = el("tbody");
  for (const i of im.cached) {
    cached.append(el("tr", { class: "cached", data: { image: i.image } }, el("td", {}, i.image),
      el("td", {}, mb(i.bytes)), el("td", {}, i.held ? "in use" : `idle ${secs(i.idle_s)} s`),
      el("td", {}, im.warm[i.image] || 0)));
  }
  if (!im.cached.length) cached.append(el("tr", {}, el("td", { colspan: 4, class: "muted" }, "no image pulled")));
  box.append(el("table", { id: "cached" }, el("thead", {}, el("tr", {}, el("th", {}, "pulled image"),
    el("th", {}, "MB"), el("th", {}, "use"), el("th", {}, "warm"))), cached));
}

function drawNodes(nodes) {
  const box = $("nodes");
  box.replaceChildren();
  for (const n of nodes) {
    const used = n.cores.filter((c) => c).length;
    const card = el("div", { class: "card node", data: { node: n.name } },
      el("h3", {}, n.name, " ", el("small", {},
        `${used}/${n.cores.length} cores held \u00b7 memory ${n.mem_reserved_gb.toFixed(1)}/` +
        `${n.mem_gb.toFixed(0)} GB reserved \u00b7 ${n.trajectories.length} trajectories bound`)));
    const grid = el("div", { class: "grid" });
    for (let d = 0; d < n.numa; d++) {
      const dom = el("div", { class: "domain", title: `NUMA domain ${d}` });
      for (let c = d * n.domain_size; c < (d + 1) * n.domain_size; c++) dom.append(coreCell(c, n.cores[c]));
      grid.append(dom);
    }
    card.append(grid, laneList(n), runningList(n));
    box.append(card);
  }
}

function coreCell(c, held) {
  if (!held) return el("div", { class: "core free", data: { core: c }, title: `core ${c}: free` }, c);
  if (!held.action) {
    return el("div", { class: "core pod", data: { core: c, trajectory: held.trajectory },
      title: `core ${c}: held by ${held.kind}${held.trajectory ? " of " + held.trajectory : ""}` },
    c, el("span", { class: "who" }, held.trajectory || held.kind));
  }
  return el("div", {
    class: "core busy", style: { background: hue(held.trajectory) },
    data: { core: c, action: held.action, trajectory: held.trajectory },
    title: `core ${c}: ${held.kind} ${held.action} of ${held.trajectory}`,
  }, c, el("span", { class: "who" }, held.kind));
}

// Light actions share the node's cores on a bounded lane instead of taking one of their own.
function laneList(n) {
  if (!n.lane_slots) return el("span");
  const row = el("p", { class: "lane", data: { node: n.name } },
    `light lane (shared cores): ${n.lane.length}/${n.lane_slots} `);
  for (const h of n.lane) {
    row.append(el("span", { class: "chip", style: { background: hue(h.trajectory) },
      data: { action: h.action, trajectory: h.trajectory },
      title: `${h.kind} ${h.action} of ${h.trajectory}` }, h.action));
  }
  return row;
}

function runningList(n) {
  const seen = new Map();
  n.cores.forEach((h, c) => {
    if (h && h.action) (seen.get(h.action) || seen.set(h.action, { ...h, cores: [] }).get(h.action)).cores.push(c);
  });
  if (!seen.size) return el("p", { class: "muted" }, "nothing running");
  const body = el("tbody");
  for (const h of seen.values()) {
    body.append(el("tr", { class: "running", data: { action: h.action } },
      el("td", {}, el("span", { class: "swatch", style: { background: hue(h.trajectory) } }), h.action),
      el("td", {}, h.trajectory), el("td", {}, h.kind), el("td", {}, h.cores.join(",")),
      el("td", { class: "tick", data: { base: h.running_s } }, secs(h.running_s))));
  }
  return el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "running action"),
    el("th", {}, "trajectory"), el("th", {}, "kind"), el("th", {}, "cores"),
    el("th", {}, "running for (s)"))), body);
}

function drawQueues(queues) {
  const box = $("queues");
  box.replaceChildren();
  const waiting = queues.filter((q) => q.length);
  if (!waiting.length) box.append(el("p", { class: "muted", id: "queues-empty" }, "no action is waiting"));
  for (const q of waiting) {
    const body = el("tbody");
    for (const w of q.waiting) {
      body.append(el("tr", { class: "queued", data: { action: w.action } },
        el("td", {}, w.action), el("td", {}, w.trajectory), el("td", {}, w.kind),
        el("td", {}, w.units_min), el("td", { class: "tick", data: { base: w.waiting_s } }, secs(w.waiting_s))));
    }
    const more = q.length > q.waiting.length ? ` (first ${q.waiting.length} shown)` : "";
    box.append(el("div", { class: "card queue", data: { pool: q.pool } },
      el("h3", {}, q.resource === "binding" ? "placement " : `pool ${q.pool} `, el("small", {},
        q.resource === "binding"
          ? `${q.length} first action(s) of trajectories waiting for a node with room${more}`
          : `${q.length} waiting for ${q.resource}${more}`)),
      el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "action"), el("th", {}, "trajectory"),
        el("th", {}, "kind"), el("th", {}, "needs at least"), el("th", {}, "waiting (s)"))), body)));
  }
}

function drawGpus(nodes) {
  const box = $("gpus");
  box.replaceChildren();
  if (!nodes.length) box.append(el("p", { class: "muted" }, "this server has no GPU nodes"));
  for (const n of nodes) {
    const grid = el("div", { class: "gpus" });
    for (const ch of n.chunks) {
      const busy = ch.state === "busy";
      grid.append(el("div", {
        class: `chunk ${ch.state}`, data: { start: ch.start, size: ch.size, action: ch.action },
        style: { gridColumn: `${ch.start + 1} / span ${ch.size}`, gridRow: "1", ...(busy ? { background: hue(ch.trajectory) } : {}) },
        title: busy ? `${ch.service} for ${ch.action}` : "free",
      }, busy ? `${ch.service} \u00b7 ${ch.action}` : `free (${ch.size})`));
    }
    // resident services below the chunks, one lane per overlap (several can share a GPU)
    const lanes = [];
    for (const r of n.resident) {
      let row = lanes.findIndex((used) => used.every(([a, b]) => r.start + r.dop <= a || b <= r.start));
      if (row < 0) row = lanes.push([]) - 1;
      lanes[row].push([r.start, r.start + r.dop]);
      grid.append(el("div", {
        class: "resident", data: { service: r.service, start: r.start, size: r.dop },
        style: { gridColumn: `${r.start + 1} / span ${r.dop}`, gridRow: `${row + 2}` },
        title: `${r.service} (DoP ${r.dop}) resident in GPU memory`,
      }, `${r.service} \u00d7${r.dop}`));
    }
    const res = n.resident.length
      ? n.resident.map((r) => `${r.service} \u00d7${r.dop} on GPU ${r.start}-${r.start + r.dop - 1}`).join("; ")
      : "none";
    box.append(el("div", { class: "card gpu-node", data: { node: n.name } },
      el("h3", {}, n.name, " ", el("small", {}, `${n.gpus} GPUs \u00d7 ${n.gpu_mem_gb} GB`)),
      grid, el("p", {}, "resident: ", res)));
  }
}

function drawQuotas(quotas) {
  const box = $("quotas");
  box.replaceChildren();
  if (!quotas.length) box.append(el("p", { class: "muted" }, "no quota configured"));
  for (const q of quotas) {
    const pct = Math.min(100, (100 * q.used) / q.limit);
    const what = q.mode === "window" ? `starts in the last ${q.window_s} s` : "in flight";
    box.append(el("div", { class: "quota", data: { key: q.key } }, el("b", {}, q.key),
      el("span", { class: "bar" }, el("span", { style: { width: `${pct}%` } })),
      `${q.used} / ${q.limit} ${what}`));
  }
}

function drawRecent(recent) {
  const body = $("recent").querySelector("tbody");
  body.replaceChildren();
  for (const r of recent) {
    body.append(el("tr", { class: "finished", data: { action: r.action, status: r.status } },
      el("td", {}, r.action), el("td", {}, r.trajectory), el("td", {}, r.kind),
      el("td", { class: `status-${r.status}` }, r.status + (r.exit_code ? ` (exit ${r.exit_code})` : "")),
      el("td", {}, r.cores || r.gpus || "-"), el("td", {}, secs(r.queue_s)),
      el("td", {}, secs(r.exec_s)), el("td", {}, secs(r.end_s))));
  }
  if (!recent.length) body.append(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "none yet")));
}

// Waiting and running times advance between snapshots (the server sends only changes).
setInterval(() => {
  if (!snap) return;
  const dt = elapsed();
  for (const td of document.querySelectorAll("td.tick")) td.textContent = secs(Number(td.dataset.base) + dt);
}, 500);

const saved = sessionStorage.getItem(TOKEN_KEY);
if (saved) start(saved, null); else showLogin();
