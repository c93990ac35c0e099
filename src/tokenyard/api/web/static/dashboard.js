// The operator dashboard: polls GET /admin/v1/dashboard every second with the admin key
// and redraws every panel from the answer. The lane switch picks whose requests and
// latencies it shows: live traffic (the default) or the Batch API's lines.

import { el, formatMs, getJSON, storeKey, storedKey, waterfall } from "/static/common.js";

const POLL_MS = 1000;
const RETRY_MS = 5000;
const $ = (id) => document.getElementById(id);
const keyInput = $("key");
const laneSelect = $("lane");
let timer = 0;
let polls = 0;
let shownRequest = null; // the request whose waterfall is open

function table(headers, rows, empty = "Nothing yet.") {
  if (!rows.length) return el("p", { class: "none" }, empty);
  const head = el("tr", {}, ...headers.map(([label, num]) => el("th", { class: num ? "num" : null }, label)));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows));
}

const num = (value, digits = 0) => (value === null || value === undefined ? "–" : Number(value).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits }));
const seconds = (s) => (s === null || s === undefined ? "–" : formatMs(s * 1000));
const percent = (f) => (f === null || f === undefined ? "–" : `${(f * 100).toFixed(1)} %`);

function meter(fraction) {
  const bar = el("span");
  bar.style.width = `${Math.min(100, Math.max(0, (fraction || 0) * 100))}%`;
  return el("span", { class: "meter" }, bar);
}

function cards(data) {
  const r = data.requests.rates;
  const replicas = data.deployments.flatMap((d) => d.replicas);
  const queued = data.deployments.reduce((n, d) => n + d.queued, 0)
    + replicas.reduce((n, m) => n + (m.waiting || 0), 0);
  const card = (label, value) => el("div", { class: "card" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value));
  $("cards").replaceChildren(
    card("Requests / s (10 s)", num(r.requests_per_s, 2)),
    card("Errors / s (10 s)", num(r.errors_per_s, 2)),
    card("Requests, last minute", num(r.requests_last_minute)),
    card("Requests since start", num(r.requests_total)),
    card("Running on replicas", num(replicas.reduce((n, m) => n + (m.running || 0), 0))),
    card("Queued", num(queued)),
  );
}

function latency(data) {
  const names = { ttft_s: "Time to first token", inter_token_s: "Inter-token", e2e_s: "End to end", queue_s: "Queue" };
  const rows = Object.entries(names).filter(([k]) => data.latency[k]).map(([k, label]) => {
    const l = data.latency[k];
    return el("tr", {}, el("td", {}, label), el("td", { class: "num" }, seconds(l.p50)),
      el("td", { class: "num" }, seconds(l.p90)), el("td", { class: "num" }, seconds(l.p99)),
      el("td", { class: "num" }, num(l.count)));
  });
  $("latency").replaceChildren(table([["", 0], ["p50", 1], ["p90", 1], ["p99", 1], ["samples", 1]], rows));
}

function refusals(data) {
  // Every reason refused since start; those of the last minute first.
  const rows = data.refusals.map((r) => el("tr", {}, el("td", {}, r.stage), el("td", {}, String(r.status)),
    el("td", { class: "mono" }, r.code || "–"), el("td", { class: "mono" }, r.route),
    el("td", { class: "num" }, num(r.count)), el("td", { class: "num" }, num(r.total))));
  $("refusals").replaceChildren(table([["stage", 0], ["status", 0], ["code", 0], ["route", 0],
    ["last minute", 1], ["since start", 1]], rows, "Nothing refused."));
}

function replicas(data) {
  const rows = data.deployments.flatMap((d) => d.replicas.map((m) => el("tr", {},
    el("td", {}, d.name), el("td", { class: "mono" }, m.id),
    el("td", {}, el("span", { class: `pill ${m.state}` }, m.state)),
    el("td", { class: "num" }, num(m.running)), el("td", { class: "num" }, num(m.waiting)),
    el("td", { class: "num" }, num(d.queued)), el("td", { class: "num" }, num(m.inflight)),
    el("td", {}, m.kv_blocks === null ? "–" : meter(m.kv_blocks_used / m.kv_blocks),
      m.kv_blocks === null ? null : `${m.kv_blocks_used} / ${m.kv_blocks}`),
    el("td", { class: "num" }, percent(m.prefix_hit_rate)),
    el("td", { class: "num" }, num(m.served)), el("td", { class: "num" }, num(m.failed)))));
  $("replicas").replaceChildren(table([["deployment", 0], ["replica", 0], ["state", 0], ["running", 1],
    ["waiting", 1], ["pool queue", 1], ["in flight", 1], ["KV blocks", 0], ["prefix hits", 1], ["served", 1], ["failed", 1]], rows));
}

function usage(id, rows, name) {
  const body = rows.map((u) => el("tr", {}, el("td", { class: "mono" }, u[name]),
    el("td", { class: "num" }, num(u.requests)), el("td", { class: "num" }, num(u.prompt_tokens)),
    el("td", { class: "num" }, num(u.cached_tokens)), el("td", { class: "num" }, num(u.output_tokens)),
    el("td", { class: "num" }, `$${u.cost}`)));
  $(id).replaceChildren(table([[name === "org_id" ? "org" : "model", 0], ["requests", 1], ["prompt", 1],
    ["cached", 1], ["output", 1], ["spend", 1]], body));
}

// Each key's and user's spend budget this worker checked: spent against each cap (a bar
// when capped) and what requests in flight hold.
function budgets(data) {
  const spent = (used, cap) => cap === null
    ? el("td", { class: "num" }, `$${used}`)
    : el("td", { class: "num" }, `$${used} of $${cap} `, meter(Number(used) / Number(cap)));
  const rows = (data.budgets || []).map((b) => el("tr", {}, el("td", {}, b.subject),
    el("td", { class: "mono" }, b.id), el("td", { class: "mono" }, b.org_id),
    spent(b.month_spent, b.monthly_budget), spent(b.total_spent, b.total_budget),
    el("td", { class: "num" }, `$${b.held}`)));
  $("budgets").replaceChildren(table([["of", 0], ["id", 0], ["org", 0], ["this month", 1],
    ["in all", 1], ["held", 1]], rows, "No budget checked yet."));
}

function recent(data) {
  const rows = [];
  for (const s of data.requests.recent) {
    const open = shownRequest === s.request_id;
    const toggle = el("button", { type: "button", "aria-expanded": String(open) }, open ? "hide" : "stages");
    toggle.addEventListener("click", () => {
      shownRequest = open ? null : s.request_id;
      recent(data);
    });
    const failed = s.status >= 400;
    rows.push(el("tr", { "data-request-id": s.request_id },
      el("td", {}, new Date(s.started_at * 1000).toLocaleTimeString([], { hour12: false })),
      el("td", { class: "mono" }, s.request_id),
      el("td", {}, el("span", { class: `pill ${failed ? "bad" : "healthy"}` }, String(s.status))),
      el("td", { class: "mono" }, `${s.method} ${s.path}`), el("td", {}, s.deployment || s.model || "–"),
      el("td", { class: "mono" }, s.org_id || "–"),
      el("td", { class: "num" }, `${num(s.prompt_tokens)} → ${num(s.output_tokens)}`),
      el("td", { class: "num" }, formatMs(s.duration_ms)),
      el("td", { class: "num" }, s.cost === null ? "–" : `$${s.cost}`),
      el("td", {}, Object.keys(s.timings_ms || {}).length ? toggle : "–")));
    if (open) rows.push(el("tr", {}, el("td", { colspan: "10" }, waterfall(s.timings_ms))));
  }
  $("recent").replaceChildren(table([["time", 0], ["request", 0], ["status", 0], ["route", 0], ["model", 0],
    ["org", 0], ["tokens", 1], ["duration", 1], ["cost", 1], ["", 0]], rows, "No requests yet."));
}

async function poll() {
  clearTimeout(timer);
  const run = ++polls; // a newer poll (the key changed) supersedes this one
  const key = keyInput.value.trim();
  try {
    const lane = encodeURIComponent(laneSelect.value);
    const data = await getJSON(`/admin/v1/dashboard?lane=${lane}`, key);
    if (run !== polls) return;
    $("error").classList.add("hidden");
    $("status").textContent = `Updated ${new Date().toLocaleTimeString([], { hour12: false })} · worker ${data.worker_pid} · up ${Math.round(data.uptime_s)} s · ${data.lane === "batch" ? "batch lines" : "live traffic"}`;
    cards(data);
    latency(data);
    refusals(data);
    replicas(data);
    usage("by-org", data.requests.by_org, "org_id");
    usage("by-model", data.requests.by_model, "model");
    budgets(data);
    recent(data);
  } catch (err) {
    if (run !== polls) return;
    $("error").textContent = err.message;
    $("error").classList.remove("hidden");
    // A refused key is not retried until it changes: every failed authentication counts
    // toward the gateway's per-address throttle, which would lock this browser out.
    const refused = err.status === 401 || err.status === 403;
    $("status").textContent = refused ? "Give an admin key." : "Not updating; trying again.";
    if (!refused) timer = setTimeout(poll, RETRY_MS);
    return;
  }
  timer = setTimeout(poll, POLL_MS);
}

keyInput.value = storedKey();
keyInput.addEventListener("change", () => {
  storeKey(keyInput.value.trim());
  poll();
});
laneSelect.addEventListener("change", () => {
  shownRequest = null;
  poll();
});
poll();
