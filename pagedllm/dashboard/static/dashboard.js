// The pagedllm dashboard: draws the state that /dashboard/events pushes (or, in a bench
// report, the frames embedded in the page as window.PAGEDLLM_FRAMES). Plain DOM + canvas.
"use strict";

const STATES = ["free", "cached", "used", "shared", "reserved"];
const STATE_COLORS = { free: "#262c33", cached: "#3d6b9c", used: null, shared: "#f2f2f2",
                       reserved: "#000000" };
const $ = (id) => document.getElementById(id);
let updates = 0;
let last = null;        // the last state drawn
let cellIndex = null;   // for the tooltip: the map's geometry
let selectedHead = "";

function hue(id) {      // a stable colour per request id
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 16777619); }
  return ((h >>> 0) % 360);
}
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const reqColor = (id) => `hsl(${hue(id)}, 70%, 55%)`;

function fmt(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(1) + "k";
  return Number(x).toFixed(digits);
}
const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%");

function setTile(id, text, value) {
  const el = $(id);
  el.textContent = text;
  el.dataset.value = value === undefined || value === null ? "" : String(value);
}

function drawTiles(state) {
  const s = state.snapshot.stats || {};
  const h = history.length ? history[history.length - 1] : {};  // (drawHistory ran first)
  setTile("t-running", fmt(s.num_running_reqs), s.num_running_reqs);
  setTile("t-waiting", fmt(s.num_waiting_reqs), s.num_waiting_reqs);
  setTile("t-preempted", fmt(s.num_preemptions), s.num_preemptions);
  setTile("t-gen", fmt(h.gen_tok_s, 1), h.gen_tok_s);
  setTile("t-prompt", fmt(h.prompt_tok_s, 1), h.prompt_tok_s);
  setTile("t-step", h.step_ms == null ? "-" : fmt(h.step_ms, 2) + " ms", h.step_ms);
  const q = s.prefix_cache_queries || 0, hits = s.prefix_cache_hits || 0;
  setTile("t-prefix-hit", q ? pct(hits / q) : "-", hits);
  $("t-prefix-hit").title = `${hits} of ${q} prompt tokens found in the prefix cache`;
  setTile("t-kv", pct(s.kv_cache_usage), s.kv_cache_usage);
  const drafts = s.spec_decode_num_draft_tokens || 0;
  setTile("t-spec", drafts ? pct((s.spec_decode_num_accepted_tokens || 0) / drafts) : "-",
          drafts ? s.spec_decode_num_accepted_tokens : "");
  setTile("t-evicted", fmt(s.kvc_evicted_kvs || 0), s.kvc_evicted_kvs || 0);
}

function drawLegend(blocks) {
  const parts = STATES.filter((n) => n !== "reserved" || blocks.counts.reserved).map((n) => {
    const c = STATE_COLORS[n] || "linear-gradient(90deg,#e45,#4c6,#58f)";
    return `<span><i style="background:${c}"></i>${n} <b data-state="${n}">${blocks.counts[n]}</b></span>`;
  });
  $("legend").innerHTML = parts.join("");
}

function drawMap(blocks) {
  const canvas = $("blockmap");
  const n = blocks.cells.length;
  const width = canvas.clientWidth || canvas.width;
  const cols = Math.max(1, Math.min(n, Math.floor(width / 6) || 1));
  const size = Math.max(2, Math.floor(width / cols));
  const rows = Math.ceil(n / cols);
  canvas.width = cols * size;
  canvas.height = Math.max(size, rows * size);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#111418";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const gap = size >= 5 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    const st = STATES[blocks.cells[i]];
    let color = STATE_COLORS[st];
    if (st === "used") {
      const o = blocks.cell_owner[i];
      color = o >= 0 ? reqColor(blocks.owners[o]) : "#888";
    }
    ctx.fillStyle = color;
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
  }
  cellIndex = { cols, size, blocks };
  const c = blocks.counts;
  for (const name of STATES) canvas.dataset[name] = String(c[name]);
  canvas.dataset.total = String(blocks.total);
  canvas.dataset.owners = String(blocks.owners.length);
  $("map-note").textContent =
    `${blocks.total} blocks of ${blocks.block_size} tokens` +
    (blocks.per_head ? " of one (layer, KV head)" : "") +
    (blocks.blocks_per_cell > 1 ? ` · ${blocks.blocks_per_cell} blocks per cell` : "") +
    (blocks.sampled_every > 1 ? ` · sampled every ${blocks.sampled_every} blocks (no owners)` : "");
  drawLegend(blocks);
}

function onMapHover(ev) {
  const tip = $("tip");
  if (!cellIndex) return;
  const canvas = $("blockmap");
  const r = canvas.getBoundingClientRect();
  const scale = canvas.width / r.width;
  const x = (ev.clientX - r.left) * scale, y = (ev.clientY - r.top) * scale;
  const { cols, size, blocks } = cellIndex;
  const i = Math.floor(y / size) * cols + Math.floor(x / size);
  if (i < 0 || i >= blocks.cells.length || x >= cols * size) { tip.hidden = true; return; }
  const k = blocks.blocks_per_cell;
  const owner = blocks.cell_owner[i] >= 0 ? blocks.owners[blocks.cell_owner[i]] : "";
  const range = k > 1 ? `blocks ${i * k}-${Math.min(blocks.total, (i + 1) * k) - 1}` : `block ${i}`;
  tip.textContent = `${range}: ${STATES[blocks.cells[i]]}${owner ? " · " + owner : ""}`;
  tip.style.left = (ev.clientX - canvas.parentElement.getBoundingClientRect().left + 12) + "px";
  tip.style.top = (ev.clientY - canvas.parentElement.getBoundingClientRect().top + 12) + "px";
  tip.hidden = false;
}

function drawHost(tiers) {
  tiers = tiers || [];
  $("host").innerHTML = tiers.map((t, i) => {
    const used = t.total ? (100 * t.used) / t.total : 0;
    const busy = t.total ? (100 * t.busy) / t.total : 0;
    const bar = t.cells ? `<canvas class="hostmap" data-i="${i}" width="600" height="10"></canvas>`
      : `<span class="track"><span style="width:${used}%;background:#3d6b9c"></span>` +
        `<span style="width:${busy}%;background:#e0a030"></span></span>`;
    return `<div class="host" data-tier="${esc(t.name)}" data-used="${t.used}"><span>${esc(t.name)}</span>` +
      bar + `<span class="dim">${t.used} / ${t.total} host blocks${t.busy ? `, ${t.busy} in flight` : ""}</span></div>`;
  }).join("");
  // a host tier with a map (the prefix cache's): one cell per block or run of blocks
  document.querySelectorAll("#host canvas.hostmap").forEach((canvas) => {
    const t = tiers[+canvas.dataset.i];
    const ctx = canvas.getContext("2d");
    const w = canvas.width / Math.max(1, t.cells.length);
    const colors = ["#262c33", "#3d6b9c", "#e0a030", "#e0a030", "#000000"];  // free, cached, in flight
    t.cells.forEach((c, j) => {
      ctx.fillStyle = colors[c] || "#888";
      ctx.fillRect(Math.floor(j * w), 0, Math.ceil(w), canvas.height);
    });
  });
}

function heatColor(v) {  // 0 (nothing kept) .. 1 (every token kept)
  const stops = [[13, 27, 42], [27, 73, 101], [95, 168, 211], [244, 211, 94], [255, 255, 255]];
  const x = Math.max(0, Math.min(1, v)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
  const c = stops[i].map((a, j) => Math.round(a + (stops[i + 1][j] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function drawHeads(heads) {
  const canvas = $("heatmap");
  const note = $("heads-note");
  const sel = $("head-select");
  if (!heads) {
    note.hidden = false;
    canvas.hidden = true;
    canvas.dataset.requests = "0";
    return;
  }
  note.hidden = true;
  canvas.hidden = false;
  const ids = heads.requests.map((r) => r.id);
  const have = Array.from(sel.options).map((o) => o.value).slice(1);
  if (have.join("\n") !== ids.join("\n")) {
    sel.innerHTML = '<option value="">all requests with a budget</option>' +
      ids.map((id) => `<option value="${esc(id)}">${esc(id)}</option>`).join("");
    sel.value = ids.includes(selectedHead) ? selectedHead : "";
  }
  let grid = heads.kept, label = grid ? "all requests with a budget" : "no request with a budget now";
  const one = heads.requests.find((r) => r.id === sel.value);
  if (one) {
    grid = one.lens.map((row) => row.map((v) => v / Math.max(1, one.num_tokens)));
    label = `one request, ${one.num_tokens} tokens`;
  }
  const L = heads.layers, H = heads.kv_heads;
  const cw = Math.max(6, Math.min(40, Math.floor(480 / Math.max(1, H))));
  const ch = Math.max(4, Math.min(18, Math.floor(360 / Math.max(1, L))));
  canvas.width = Math.max(420, H * cw + 40);
  canvas.height = L * ch + 14;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#1a1f25";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.font = "10px system-ui";
  let sum = 0, cells = 0;
  for (let l = 0; l < L; l++) {
    for (let h = 0; h < H; h++) {
      const v = grid ? grid[l][h] : null;
      if (v !== null) { sum += v; cells++; }
      ctx.fillStyle = v === null ? "#262c33" : heatColor(v);
      ctx.fillRect(40 + h * cw, l * ch, cw - 1, ch - 1);
    }
    if (ch >= 9 || l % 4 === 0) {
      ctx.fillStyle = heads.compressible[l] ? "#8b949e" : "#e0a030";
      ctx.fillText(`L${l}`, 2, l * ch + ch - 2);
    }
  }
  ctx.fillStyle = "#8b949e";
  ctx.fillText(`${H} KV heads → · ${label}`, 40, L * ch + 11);
  canvas.dataset.requests = String(heads.requests.length);
  canvas.dataset.keptMean = cells ? (sum / cells).toFixed(4) : "";
  canvas.dataset.selected = sel.value;
}

function drawChart(id, series, colors, maxFixed) {
  const canvas = $(id);
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height;
  ctx.fillStyle = "#1a1f25";
  ctx.fillRect(0, 0, W, H);
  const all = series.flat().filter((v) => v !== null && v !== undefined);
  const max = maxFixed || Math.max(1e-9, ...all) * 1.1;
  const n = Math.max(2, ...series.map((s) => s.length));
  series.forEach((s, k) => {
    ctx.strokeStyle = colors[k];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    s.forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      const x = (i / (n - 1)) * (W - 2) + 1, y = H - 2 - (v / max) * (H - 14);
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
  });
  ctx.fillStyle = "#8b949e";
  ctx.font = "10px system-ui";
  ctx.fillText(fmt(max, max < 10 ? 2 : 0), 2, 10);
  canvas.dataset.points = String(n);
}

let history = [];
function drawHistory(points, replace) {
  history = replace ? points.slice() : history.concat(points);
  if (history.length > 600) history = history.slice(history.length - 600);
  const pick = (k, f = (x) => x) => history.map((p) => (p[k] === null ? null : f(p[k])));
  drawChart("c-kv", [pick("kv_usage", (x) => 100 * x)], ["#5fa8d3"], 100);
  drawChart("c-gen", [pick("gen_tok_s")], ["#4cc38a"]);
  drawChart("c-queue", [pick("running"), pick("waiting")], ["#5fa8d3", "#e0a030"]);
  drawChart("c-step", [pick("step_ms")], ["#c792ea"]);
}

function drawRequests(rows, total) {
  const body = $("requests").tBodies[0];
  body.innerHTML = rows.map((r) =>
    `<tr data-id="${esc(r.id)}" data-status="${r.status}"><td><span class="sw" style="background:${reqColor(r.id)}"></span>${esc(r.id)}</td>` +
    `<td>${r.status}${r.lora ? " · " + esc(r.lora) : ""}</td><td>${r.prompt_tokens}</td><td>${r.output_tokens}</td>` +
    `<td>${r.computed_tokens}</td><td>${r.cached_tokens}</td><td>${r.blocks}</td>` +
    `<td>${r.kvc || ""}</td><td>${r.held_kvs === null ? "" : r.held_kvs}</td><td>${r.age_s.toFixed(1)}</td></tr>`
  ).join("");
  $("req-note").textContent = rows.length < total ? `(first ${rows.length} of ${total})` : `(${rows.length})`;
}

function render(state, replaceHistory) {
  const snap = state.snapshot;
  last = state;
  updates++;
  $("updates").textContent = String(updates);
  document.body.dataset.version = String(state.version);
  $("model").textContent = state.model + (snap.cores > 1 ? ` · ${snap.cores} data-parallel cores (core 0's pool)` : "");
  $("build-ms").textContent = snap.build_ms.toFixed(2);
  $("period").textContent = state.period_s ? state.period_s.toFixed(2) : "-";
  drawHistory(state.history, replaceHistory);
  drawTiles(state);
  drawMap(snap.blocks);
  drawHost(snap.host);
  drawHeads(snap.heads);
  drawRequests(snap.requests, (snap.stats.num_running_reqs || 0) + (snap.stats.num_waiting_reqs || 0));
}

function live() {
  const hz = new URLSearchParams(location.search).get("hz");
  const es = new EventSource("/dashboard/events" + (hz ? "?hz=" + encodeURIComponent(hz) : ""));
  let first = true;
  es.onmessage = (ev) => {
    document.body.dataset.state = "live";
    $("conn").textContent = "live";
    render(JSON.parse(ev.data), first);
    first = false;
  };
  es.addEventListener("engine-error", (ev) => {  // the server is up, the engine is not
    document.body.dataset.state = "lost";
    $("conn").textContent = "engine: " + JSON.parse(ev.data).error;
  });
  es.onerror = () => {
    document.body.dataset.state = "lost";
    $("conn").textContent = "reconnecting";
    first = true;
  };
}

function offline(frames) {  // a bench report: a slider over the recorded frames
  document.body.dataset.state = "report";
  $("conn").textContent = `report · ${frames.length} frames`;
  const slider = document.createElement("input");
  slider.type = "range"; slider.min = 0; slider.max = frames.length - 1; slider.value = frames.length - 1;
  slider.id = "frame"; slider.style.width = "400px";
  const label = document.createElement("span");
  label.className = "dim";
  document.querySelector("header").append(slider, label);
  $("history-title").textContent = "The run";
  const show = () => {
    const f = frames[+slider.value];
    label.textContent = `frame ${+slider.value + 1}: t = ${(f.snapshot.time - frames[0].snapshot.time).toFixed(1)} s`;
    render(f, true);
  };
  slider.oninput = show;
  show();
}

$("blockmap").addEventListener("mousemove", onMapHover);
$("blockmap").addEventListener("mouseleave", () => { $("tip").hidden = true; });
$("head-select").addEventListener("change", (ev) => {
  selectedHead = ev.target.value;
  if (last) drawHeads(last.snapshot.heads);
});
async function start() {  // the server may want its API key: ask for it once, then go live
  const r = await fetch("/dashboard/state", { credentials: "same-origin" });
  if (r.status !== 401) { live(); return; }
  document.body.dataset.state = "login";
  $("conn").textContent = "API key needed";
  const form = $("login");
  form.hidden = false;
  form.onsubmit = async (ev) => {
    ev.preventDefault();
    const res = await fetch("/dashboard/login", {
      method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ api_key: $("key").value }) });
    if (res.ok) { form.hidden = true; live(); } else { $("login-error").textContent = "wrong key"; }
  };
}

if (window.PAGEDLLM_FRAMES) offline(window.PAGEDLLM_FRAMES); else start();
