// Mini-vLLM live view: follows /ws/events (one record per engine step) and draws the requests' states,
// the KV block grid, each step's batch, throughput / latency, the scheduler's events and, for a mixture of
// experts, a heat map of the tokens routed to each expert. No libraries.
"use strict";
const MAX_ROWS = 200, MAX_POINTS = 240, MAX_LOG = 300;
const requests = new Map();            // request id -> {state, tokens, history, row}
const stepPts = [], tputPts = [], latPts = [];
let lastKv = null, stepsSeen = 0;
let expertBase = null, expertNow = null;  // {layer: [tokens per expert]}: at hello, and the latest snapshot

const $ = (id) => document.getElementById(id);
function hue(s) { let h = 0; for (const c of s) h = (h * 31 + c.charCodeAt(0)) >>> 0; return h % 360; }
function color(rid) { return `hsl(${hue(rid)}, 65%, 50%)`; }

function log(text) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toLocaleTimeString()} ${text}`;
  const ol = $("log");
  ol.prepend(li);
  while (ol.children.length > MAX_LOG) ol.lastChild.remove();
}

function setState(rid, state, tokens) {
  let r = requests.get(rid);
  if (!r) {
    const row = document.createElement("tr");
    row.dataset.requestId = rid;
    row.innerHTML = `<td class="rid"></td><td class="state"></td><td class="tokens">0</td><td class="history"></td>`;
    row.querySelector(".rid").textContent = rid.length > 24 ? rid.slice(0, 24) + "…" : rid;
    row.querySelector(".rid").style.setProperty("--c", color(rid));
    $("requests").prepend(row);
    r = {state: null, tokens: 0, history: [], row};
    requests.set(rid, r);
    while (requests.size > MAX_ROWS) {          // forget the oldest finished rows first
      const old = [...requests.entries()].find(([, v]) => v.state === "FINISHED" || v.state === "ABORTED");
      const [k, v] = old || requests.entries().next().value;
      v.row.remove(); requests.delete(k);
    }
  }
  if (tokens) r.tokens += tokens;
  r.row.querySelector(".tokens").textContent = r.tokens;
  if (r.state === state) return;
  r.state = state;
  if (r.history[r.history.length - 1] !== state) r.history.push(state);
  r.row.dataset.state = state;
  r.row.dataset.history = r.history.join(">");
  r.row.querySelector(".state").innerHTML = `<span class="st ${state}">${state}</span>`;
  r.row.querySelector(".history").textContent = r.history.join(" → ");
}

function onStep(rec) {
  if (rec.type !== "step") { log(rec.message || "an unreadable record"); return; }
  stepsSeen += 1;
  for (const rid of rec.waiting) {
    const r = requests.get(rid);
    if (!r) { setState(rid, "WAITING"); log(`queued ${rid}`); }
  }
  const swappedOut = new Set(rec.swapped_out || []);
  for (const rid of rec.preempted) {
    setState(rid, "PREEMPTED");
    log(`preempted ${rid} (${swappedOut.has(rid) ? "swap" : "recompute"})`);
  }
  let decode = 0, prefill = 0;
  for (const [rid, kind, n] of rec.batch) {
    const r = requests.get(rid);
    if (!r || r.state === "WAITING" || r.state === "PREEMPTED") log(`admitted ${rid}`);
    if (kind === "prefill") { prefill += n; log(`prefill chunk of ${n} tokens for ${rid}`); setState(rid, "PREFILL"); }
    else { decode += n; setState(rid, "DECODE", n); }
  }
  if (rec.prefix_cache_hits > 0) log(`prefix cache hit: ${rec.prefix_cache_hits} of ${rec.prefix_cache_queries} prompt tokens`);
  for (const [rid, reason, e2e] of rec.finished) {
    setState(rid, reason === "abort" ? "ABORTED" : "FINISHED");
    log(`${reason === "abort" ? "aborted" : "finished (" + reason + ")"} ${rid} after ${(e2e * 1000).toFixed(0)} ms`);
    latPts.push({t: rec.t, e2e, ttft: null});
  }
  for (const t of rec.ttft) latPts.push({t: rec.t, e2e: null, ttft: t});
  if (rec.batch.length) stepPts.push({decode, prefill, budget: rec.token_budget});
  tputPts.push({t: rec.t, gen: rec.generation_tokens});
  for (const a of [stepPts, tputPts, latPts]) while (a.length > MAX_POINTS) a.shift();
  $("running").textContent = rec.num_running;
  $("waiting").textContent = rec.num_waiting;
  if (rec.kv) {   // owners arrive as little-endian int32s in base64
    const bytes = Uint8Array.from(atob(rec.kv.owners_b64), (c) => c.charCodeAt(0));
    rec.kv.owners = new Int32Array(bytes.buffer);
    lastKv = rec.kv;
  }
}

function drawKv() {
  const kv = lastKv, cv = $("kv"), ctx = cv.getContext("2d");
  if (!kv) return;
  const n = kv.num_blocks, cols = Math.ceil(Math.sqrt(n * cv.width / cv.height));
  const rows = Math.ceil(n / cols), w = cv.width / cols, h = cv.height / rows;
  const shared = new Set(kv.shared);
  let owned = 0, cached = 0;
  ctx.clearRect(0, 0, cv.width, cv.height);
  for (let b = 0; b < n; b++) {
    const o = kv.owners[b], x = (b % cols) * w, y = Math.floor(b / cols) * h;
    if (o >= 0) { owned++; ctx.fillStyle = color(kv.requests[o]); }
    else if (o === -2) { cached++; ctx.fillStyle = "#c7d2fe"; }
    else ctx.fillStyle = "#eef0f3";
    ctx.fillRect(x, y, Math.max(1, w - (w > 3 ? 1 : 0)), Math.max(1, h - (h > 3 ? 1 : 0)));
    if (shared.has(b) && w > 3) { ctx.strokeStyle = "#111"; ctx.strokeRect(x + 0.5, y + 0.5, w - 2, h - 2); }
  }
  const s = $("kv-stats");
  Object.assign(s.dataset, {total: n, used: kv.used, owned, cached, shared: kv.shared.length});
  s.textContent = `${kv.used} of ${n} blocks in use (${kv.block_size} tokens each), ${cached} cached-free, ` +
                  `${kv.shared.length} shared, ${kv.requests.length} requests holding blocks`;
}

function axes(ctx, cv, maxY, label) {
  ctx.clearRect(0, 0, cv.width, cv.height);
  ctx.fillStyle = "#666"; ctx.font = "10px sans-serif";
  ctx.fillText(`${label} (max ${maxY.toFixed(maxY < 10 ? 2 : 0)})`, 4, 10);
}

function drawSteps() {
  const cv = $("steps"), ctx = cv.getContext("2d");
  const maxY = Math.max(1, ...stepPts.map((p) => Math.max(p.decode + p.prefill, p.budget)));
  axes(ctx, cv, maxY, "tokens per step");
  const w = cv.width / MAX_POINTS, sy = (v) => cv.height - (v / maxY) * (cv.height - 14);
  stepPts.forEach((p, i) => {
    ctx.fillStyle = "#3b82f6"; ctx.fillRect(i * w, sy(p.decode), Math.max(1, w - 0.5), cv.height - sy(p.decode));
    ctx.fillStyle = "#f59e0b"; ctx.fillRect(i * w, sy(p.decode + p.prefill), Math.max(1, w - 0.5), sy(p.decode) - sy(p.decode + p.prefill));
  });
  if (stepPts.length) { ctx.strokeStyle = "#ef4444"; ctx.beginPath(); ctx.moveTo(0, sy(stepPts[stepPts.length - 1].budget)); ctx.lineTo(cv.width, sy(stepPts[stepPts.length - 1].budget)); ctx.stroke(); }
  cv.dataset.points = stepPts.length;
}

function line(ctx, cv, pts, key, maxY, t0, t1, style) {
  ctx.strokeStyle = style; ctx.beginPath();
  let first = true;
  for (const p of pts) {
    if (p[key] == null) continue;
    const x = ((p.t - t0) / Math.max(1e-9, t1 - t0)) * cv.width, y = cv.height - (p[key] / maxY) * (cv.height - 14);
    if (first) { ctx.moveTo(x, y); first = false; } else ctx.lineTo(x, y);
  }
  ctx.stroke();
}

function drawCharts() {
  const now = Date.now() / 1000, t0 = now - 30;
  // Output tok/s over 1-second windows.
  const secs = new Map();
  for (const p of tputPts) if (p.t >= t0) { const k = Math.floor(p.t); secs.set(k, (secs.get(k) || 0) + p.gen); }
  const tp = [...secs.entries()].sort((a, b) => a[0] - b[0]).map(([k, v]) => ({t: k + 0.5, v}));
  const cv = $("throughput"), ctx = cv.getContext("2d"), maxT = Math.max(1, ...tp.map((p) => p.v));
  axes(ctx, cv, maxT, "output tok/s (last 30 s)");
  line(ctx, cv, tp, "v", maxT, t0, now, "#10b981");
  cv.dataset.points = tp.length;
  $("toks").textContent = tp.length > 1 ? tp[tp.length - 2].v : 0;
  const lv = $("latency"), lctx = lv.getContext("2d");
  const recent = latPts.filter((p) => p.t >= t0), maxL = Math.max(0.001, ...recent.map((p) => p.e2e ?? p.ttft));
  axes(lctx, lv, maxL, "seconds: TTFT (orange), end-to-end (blue)");
  line(lctx, lv, recent, "ttft", maxL, t0, now, "#f59e0b");
  line(lctx, lv, recent, "e2e", maxL, t0, now, "#3b82f6");
  lv.dataset.points = recent.length;
}

// The server's admin (or API) key, when it has one: opened as /dashboard?token=<key>, kept for this tab only
// and taken out of the address bar; the feed gets it as a WebSocket subprotocol (a browser cannot set headers).
const token = (() => {
  const params = new URLSearchParams(location.search);
  const given = params.get("token");
  if (given !== null) {
    sessionStorage.setItem("minivllm-token", given);
    params.delete("token");
    history.replaceState(null, "", location.pathname + (params.toString() ? `?${params}` : ""));
  }
  return sessionStorage.getItem("minivllm-token");
})();

function openFeed() {
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/events`;
  if (!token) return new WebSocket(url);
  try {
    return new WebSocket(url, [`minivllm-key.${token}`]);
  } catch (e) {  // a key with characters a subprotocol cannot hold: the query parameter instead
    return new WebSocket(`${url}?token=${encodeURIComponent(token)}`);
  }
}

function connect() {
  const ws = openFeed();
  ws.onopen = () => { $("status").textContent = "live"; $("status").dataset.state = "live"; };
  ws.onclose = (ev) => {
    $("status").dataset.state = "closed";
    if (ev.code === 1008) { $("status").textContent = "refused: open /dashboard?token=<key>"; return; }
    $("status").textContent = ev.code === 1013 ? "too many live views open (retrying)" : "disconnected (retrying)";
    setTimeout(connect, ev.code === 1013 ? 10000 : 2000);
  };
  ws.onmessage = (ev) => {
    const msg = JSON.parse(ev.data);
    if (msg.type === "hello") {
      $("model").textContent = msg.model;
      if (msg.expert_load && Object.keys(msg.expert_load).length) {
        expertBase = expertNow = msg.expert_load;
        $("experts-panel").hidden = false;
      }
    }
    else if (msg.type === "error") { $("status").textContent = msg.message; }
    else if (msg.type === "steps") {
      msg.records.forEach(onStep);
      $("dropped").textContent = msg.dropped;
      $("steps-seen").textContent = stepsSeen;
      if (msg.expert_load) expertNow = msg.expert_load;
    }
  };
}

// Rows: sparse layers; columns: experts; shade: an expert's share of its layer's routed tokens since the page
// connected, against the busiest expert of that layer (an even spread is evenly shaded).
function drawExperts() {
  if (!expertNow) return;
  const layers = Object.keys(expertNow).map(Number).sort((a, b) => a - b);
  const cv = $("experts"), ctx = cv.getContext("2d");
  const n = Math.max(...layers.map((l) => expertNow[l].length)), left = 34, top = 4;
  const w = (cv.width - left) / n, h = (cv.height - top) / layers.length;
  const routed = [];
  ctx.clearRect(0, 0, cv.width, cv.height);
  ctx.font = "10px sans-serif";
  layers.forEach((l, row) => {
    const counts = expertNow[l].map((c, e) => c - ((expertBase[l] || [])[e] || 0));
    const peak = Math.max(1, ...counts);
    routed.push(counts.reduce((a, b) => a + b, 0));
    counts.forEach((c, e) => {
      const x = left + e * w, y = top + row * h, f = c / peak;
      ctx.fillStyle = `hsl(230, 70%, ${96 - 66 * f}%)`;
      ctx.fillRect(x, y, Math.max(1, w - (w > 3 ? 1 : 0)), Math.max(1, h - (h > 3 ? 1 : 0)));
      if (w >= 24 && h >= 14) { ctx.fillStyle = f > 0.5 ? "#fff" : "#333"; ctx.fillText(`${c}`, x + 3, y + 12); }
    });
    if (h >= 9) { ctx.fillStyle = "#666"; ctx.fillText(`L${l}`, 2, top + row * h + Math.min(h, 14) - 3); }
  });
  const s = $("experts-stats");
  Object.assign(s.dataset, {layers: layers.join(","), routed: routed.join(","), experts: n});
  s.textContent = `${layers.length} sparse layers x ${n} experts; ${routed.reduce((a, b) => a + b, 0)} tokens ` +
                  "routed since this view connected";
}

// Redrawn 4 times a second: enough to follow, cheap for the machine that serves.
function frame() { drawKv(); drawSteps(); drawCharts(); drawExperts(); }
connect();
setInterval(frame, 250);
