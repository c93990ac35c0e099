// The chat page: a conversation with one model over /v1/chat/completions, streamed.
//
// A reply streams through fetch + ReadableStream (SSE parsed here); while it streams the
// input is locked and Stop aborts the fetch, which closes the connection: the server
// then closes the replica's stream, and the replica frees the request's KV blocks.
// The stream's last event carries `usage`, `timings` (stage → ms) and, when the request
// was billed, `cost`: they go under the reply as figures and a waterfall.

import { authHeaders, el, formatCost, formatMs, getJSON, responseError, storeKey, storedKey, waterfall } from "/static/common.js";
import { renderMarkdown } from "/static/markdown.js";

const MODEL_STORE = "tokenyard.model";
const $ = (id) => document.getElementById(id);
const ui = {
  key: $("key"), forget: $("forget"), model: $("model"), modelsError: $("models-error"),
  system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"),
  clear: $("clear"), conversation: $("conversation"),
  empty: $("empty"), composer: $("composer"), input: $("input"), send: $("send"),
  stop: $("stop"), inputError: $("input-error"),
};
// The conversation sent with each request (without the system prompt, added per send).
let history = [];
let controller = null;

function showError(node, text) {
  node.textContent = text || "";
  node.classList.toggle("hidden", !text);
}

async function loadModels() {
  try {
    const list = await getJSON("/v1/models", ui.key.value.trim());
    // Only what can chat (an embeddings model would answer 400); a server that does not
    // say what its models can do gets every model listed.
    const chat = list.data.filter((m) => !Array.isArray(m.capabilities) || m.capabilities.includes("chat"));
    const previous = ui.model.value || localStorage.getItem(MODEL_STORE);
    ui.model.replaceChildren(...chat.map((m) => el("option", { value: m.id }, m.id)));
    if (chat.some((m) => m.id === previous)) ui.model.value = previous;
    showError(ui.modelsError, "");
  } catch (err) {
    const noKey = err.status === 401 && !ui.key.value.trim();
    showError(ui.modelsError, noKey ? "Enter an API key to list the models." : `Models: ${err.message}`);
  }
}

// The parameters, or an error naming the field that is wrong. An empty temperature is
// none: the deployment's default applies.
function readSettings() {
  const t = ui.temperature.value.trim();
  const temperature = t === "" ? undefined : Number(t);
  if (t !== "" && (!Number.isFinite(temperature) || temperature < 0 || temperature > 2)) {
    return { error: "Temperature must be a number from 0 to 2.", field: ui.temperature };
  }
  const m = ui.maxTokens.value.trim();
  if (!/^\d{1,7}$/.test(m) || Number(m) < 1) {
    return { error: "Max tokens must be a whole number of at least 1.", field: ui.maxTokens };
  }
  if (!ui.model.value) return { error: "Pick a model (give a valid key to list them).", field: ui.model };
  return { temperature, maxTokens: Number(m), model: ui.model.value };
}

function setStreaming(on) {
  ui.input.disabled = on;
  ui.send.disabled = on;
  ui.stop.disabled = !on;
  ui.clear.disabled = on;
  if (!on) ui.input.focus();
}

function addMessage(role, text) {
  ui.empty.classList.add("hidden");
  const body = el("div", { class: "body" }, role === "user" ? text : null);
  const node = el("div", { class: `msg ${role}` }, el("div", { class: "who" }, role === "user" ? "You" : ui.model.value), body);
  ui.conversation.append(node);
  node.scrollIntoView({ block: "end" });
  return { node, body };
}

// SSE events of a fetch response, as parsed JSON (or "[DONE]").
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data === "[DONE]" ? data : JSON.parse(data);
    }
  }
}

function finishReply(reply, { state, usage, timings, cost, started, error }) {
  reply.node.classList.remove("streaming");
  reply.node.dataset.state = state;
  const meta = el("div", { class: "meta" });
  if (state === "stopped") meta.append(el("span", { class: "stopped" }, "stopped"));
  if (usage) meta.append(el("span", {}, `${usage.prompt_tokens} prompt → ${usage.completion_tokens} tokens`));
  if (timings) meta.append(el("span", {}, formatMs(performance.now() - started)));
  const money = formatCost(cost);
  if (money) meta.append(el("span", { class: "cost" }, `cost ${money}`));
  if (meta.childNodes.length) reply.node.append(meta);
  if (timings) {
    reply.node.append(el("details", { class: "stages", open: "" },
      el("summary", {}, "Stages on the server"), waterfall(timings)));
  }
  if (error) reply.node.append(el("p", { class: "error", role: "alert" }, error));
}

async function send(text) {
  const settings = readSettings();
  if (settings.error) {
    showError(ui.inputError, settings.error);
    settings.field.setAttribute("aria-invalid", "true");
    settings.field.focus();
    return;
  }
  const messages = [...history, { role: "user", content: text }];
  const system = ui.system.value.trim();
  const body = {
    model: settings.model, messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    max_tokens: settings.maxTokens, stream: true, stream_options: { include_usage: true },
  };
  if (settings.temperature !== undefined) body.temperature = settings.temperature;
  addMessage("user", text);
  ui.input.value = "";
  const reply = addMessage("assistant", "");
  reply.node.classList.add("streaming");
  reply.node.dataset.state = "streaming";
  controller = new AbortController();
  setStreaming(true);
  const started = performance.now();
  const result = { state: "done", started };
  let content = "";
  let frame = 0;
  const paint = () => {
    frame = 0;
    reply.body.replaceChildren(renderMarkdown(content));
    reply.node.scrollIntoView({ block: "end" });
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders(ui.key.value.trim()) },
      body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(await responseError(response));
    for await (const event of events(response)) {
      if (event === "[DONE]") break;
      if (event.error) throw new Error(`Error: ${event.error.message}`);
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        content += delta;
        if (!frame) frame = requestAnimationFrame(paint);
      }
      if (event.usage) result.usage = event.usage;
      if (event.timings) result.timings = event.timings;
      if (event.cost !== undefined) result.cost = event.cost;
    }
  } catch (err) {
    if (err.name === "AbortError") result.state = "stopped";
    else Object.assign(result, { state: "error", error: err.message });
  } finally {
    controller = null;
    if (frame) cancelAnimationFrame(frame);
    paint();
    if (content) history = [...messages, { role: "assistant", content }];
    else if (result.state === "error") ui.input.value = text; // nothing came back: send again
    finishReply(reply, result);
    setStreaming(false);
  }
}

ui.key.value = storedKey();
ui.key.addEventListener("change", () => {
  storeKey(ui.key.value.trim());
  loadModels();
});
ui.forget.addEventListener("click", () => {
  ui.key.value = "";
  storeKey("");
});
ui.model.addEventListener("change", () => localStorage.setItem(MODEL_STORE, ui.model.value));
for (const field of [ui.temperature, ui.maxTokens, ui.model]) {
  field.addEventListener("input", () => {
    field.removeAttribute("aria-invalid");
    showError(ui.inputError, "");
  });
}
ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  if (controller) return;
  const text = ui.input.value.trim();
  if (!text) {
    showError(ui.inputError, "Type a message first.");
    return;
  }
  showError(ui.inputError, "");
  send(text);
});
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && controller) controller.abort();
});
ui.stop.addEventListener("click", () => controller?.abort());
ui.clear.addEventListener("click", () => {
  history = [];
  ui.conversation.replaceChildren(ui.empty);
  ui.empty.classList.remove("hidden");
  ui.input.focus();
});
loadModels();
ui.input.focus();
