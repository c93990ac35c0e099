// What both pages share: the stored key, element building, the API's errors as the user
// reads them, and the stage waterfall of one request's `timings`.
//
// Nothing here writes markup from strings: every text goes in through textContent.

const KEY_STORE = "tokenyard.apiKey";

export function storedKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function storeKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

export function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// el("td", {class: "num"}, "12") — attributes are set one by one, children appended
// as text nodes (strings) or elements.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== undefined && value !== null && value !== false) node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

// An API error (OpenAI's or Anthropic's body, or none) as one line for the user:
// the status, the server's own message, the parameter it names, when to retry.
export function describeError(status, body, headers) {
  const err = (body && body.error) || {};
  let text = `Error ${status}: ${err.message || "the server gave no message."}`;
  if (err.param) text += ` (parameter: ${err.param})`;
  const retry = headers && headers.get("retry-after");
  if (status === 429 && retry) text += ` Retry after ${retry} s.`;
  return text;
}

// The error of a failed response (its body read here).
export async function responseError(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: the status alone
  }
  return describeError(response.status, body, response.headers);
}

// GET `path` with `key`; a failure throws an Error with the API's words and `status`.
export async function getJSON(path, key) {
  const response = await fetch(path, { headers: authHeaders(key) });
  if (!response.ok) {
    const err = new Error(await responseError(response));
    err.status = response.status;
    throw err;
  }
  return response.json();
}

// Stages in request order (telemetry/timeline.py's EVENTS): each starts where the
// previous one ended. The accumulated stages overlap the one they run inside.
const SEQUENTIAL = ["auth", "parse", "template", "tokenize", "authorize", "limit", "billing",
  "queue", "prefill", "decode"];
const INSIDE = { balance: "queue", moderate: "queue", detokenize: "decode" };
const GATEWAY = new Set(["auth", "parse", "template", "tokenize", "authorize", "limit", "billing", "balance", "moderate"]);

function stageClass(stage) {
  if (GATEWAY.has(stage)) return "gateway";
  if (stage === "queue" || stage === "prefill" || stage === "decode") return stage;
  return "other";
}

export function formatMs(ms) {
  if (ms === null || ms === undefined) return "–";
  if (ms >= 1000) return `${(ms / 1000).toFixed(2)} s`;
  if (ms >= 10) return `${ms.toFixed(0)} ms`;
  return `${ms.toFixed(2)} ms`;
}

// One row per measured stage, each bar placed at its start on a common time axis.
export function waterfall(timings) {
  const starts = {};
  let t = 0;
  for (const stage of SEQUENTIAL) {
    if (stage in timings) {
      starts[stage] = t;
      t += timings[stage];
    }
  }
  for (const [stage, ms] of Object.entries(timings)) {
    if (!(stage in starts)) starts[stage] = starts[INSIDE[stage]] ?? 0;
    t = Math.max(t, starts[stage] + ms);
  }
  const total = t || 1;
  const box = el("div", { class: "waterfall", role: "img", "aria-label": `Stages, ${formatMs(t)} in all` });
  const order = Object.keys(timings).sort((a, b) => starts[a] - starts[b]);
  for (const stage of order) {
    const bar = el("div", { class: `bar ${stageClass(stage)}`, title: `${stage}: ${formatMs(timings[stage])}` });
    bar.style.left = `${(100 * starts[stage]) / total}%`;
    bar.style.width = `${(100 * timings[stage]) / total}%`;
    box.append(el("div", { class: "bar-row" }, el("span", {}, stage), el("div", { class: "track" }, bar),
      el("span", { class: "ms" }, formatMs(timings[stage]))));
  }
  return box;
}

// A request's cost as the API gives it: a money string, or an object with its total.
export function formatCost(cost) {
  if (cost === null || cost === undefined) return null;
  if (typeof cost === "object") {
    const total = cost.total ?? cost.amount;
    if (total === undefined) return null;
    return cost.currency && cost.currency !== "USD" ? `${total} ${cost.currency}` : `$${total}`;
  }
  return `$${cost}`;
}
