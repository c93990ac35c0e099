// The Vercel AI SDK against tokenyard serve: each cell named on the command line runs
// once and prints one JSON line, {"cell", "ok", ...what it got} or {"cell", "ok": false,
// "error"}. tests/clients/test_vercel_ai.py runs this and makes the checks, the same ones
// the Python clients get; this file only gathers what the SDK handed back.
//
// Environment: TOKENYARD_URL (the server's base URL), TOKENYARD_API_KEY, TOKENYARD_MODEL,
// TOKENYARD_EMBEDDING_MODEL.
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { embedMany, generateText, Output, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const base = env("TOKENYARD_URL");
const apiKey = env("TOKENYARD_API_KEY");
const modelId = env("TOKENYARD_MODEL");
const embeddingModel = env("TOKENYARD_EMBEDDING_MODEL");

const HELLO = "Say hello in one short sentence.";
const ASK_WEATHER = "What is the weather in Paris?";
const ASK_CITY = "Describe Paris as a JSON object.";
const WEATHER_RESULT = "18 degrees and sunny";
const cold = { temperature: 0, maxRetries: 0 };
const short = { ...cold, maxOutputTokens: 16 };
const long = { ...cold, maxOutputTokens: 48 };

// The same shapes as tests/clients/conftest.py's WEATHER_SCHEMA and City.
const City = z.object({
  name: z.string().max(16),
  size: z.enum(["village", "town", "city"]),
}).strict();
const weather = tool({
  description: "The current weather in a city.",
  inputSchema: z.object({
    city: z.string().max(20),
    unit: z.enum(["celsius", "fahrenheit"]),
  }).strict(),
  execute: async ({ city }) => `${WEATHER_RESULT} in ${city}`,
});

const compatible = createOpenAICompatible({
  name: "tokenyard", baseURL: `${base}/v1`, apiKey, includeUsage: true,
  supportsStructuredOutputs: true,
});
const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey });
const anthropic = createAnthropic({ baseURL: `${base}/v1`, apiKey });

function usageOf(usage) {
  return {
    input: usage.inputTokens ?? null,
    output: usage.outputTokens ?? null,
    cached: usage.inputTokenDetails?.cacheReadTokens ?? null,
  };
}

async function text(model) {
  const r = await generateText({ model, prompt: HELLO, ...short });
  return { text: r.text, usage: usageOf(r.usage) };
}

async function stream(model) {
  let failure;  // streamText reports a failed call here, not by throwing
  const r = streamText({ model, prompt: HELLO, ...short, onError: ({ error }) => { failure = error; } });
  const deltas = [];
  for await (const delta of r.textStream) deltas.push(delta);
  if (failure) throw failure;
  return { text: deltas.join(""), deltas: deltas.length, usage: usageOf(await r.usage) };
}

async function structured(model) {
  const r = await generateText({ model, prompt: ASK_CITY, output: Output.object({ schema: City }), ...long });
  return { object: r.output };
}

// One call per step, each provider's way: with parallel calls allowed SmolLM2 starts a
// second call after the first and runs out of tokens.
const oneCall = {
  tokenyard: { parallel_tool_calls: false },
  openai: { parallelToolCalls: false },
  anthropic: { disableParallelToolUse: true },
};

// Two steps: the first must call the tool, the second must answer in text.
async function toolLoop(model) {
  const r = await generateText({
    model, prompt: ASK_WEATHER, tools: { get_weather: weather }, ...long,
    providerOptions: oneCall,
    stopWhen: stepCountIs(2),
    prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }),
  });
  const calls = r.steps.flatMap((s) => s.toolCalls);
  const results = r.steps.flatMap((s) => s.toolResults);
  const body = r.steps[1]?.request?.body;  // what the second step sent the server
  return {
    steps: r.steps.length,
    calls: calls.map((c) => ({ name: c.toolName, args: c.input })),
    results: results.map((x) => String(x.output)),
    secondRequest: typeof body === "string" ? body : JSON.stringify(body ?? null),
    text: r.text,
  };
}

async function embeddings(model) {
  const r = await embedMany({ model, values: ["one", "two"], maxRetries: 0 });
  return { vectors: r.embeddings.map((v) => v.length), usage: r.usage };
}

const cells = {
  "compatible-chat": () => text(compatible.chatModel(modelId)),
  "compatible-stream": () => stream(compatible.chatModel(modelId)),
  "compatible-structured": () => structured(compatible.chatModel(modelId)),
  "compatible-tools": () => toolLoop(compatible.chatModel(modelId)),
  "compatible-embeddings": () => embeddings(compatible.textEmbeddingModel(embeddingModel)),
  "openai-chat": () => text(openai.chat(modelId)),
  "openai-structured": () => structured(openai.chat(modelId)),
  "openai-tools": () => toolLoop(openai.chat(modelId)),
  "openai-embeddings": () => embeddings(openai.embedding(embeddingModel)),
  // openai(model) is the Responses API, the provider's default.
  "openai-responses": () => text(openai(modelId)),
  "openai-responses-stream": () => stream(openai(modelId)),
  "openai-responses-tools": () => toolLoop(openai(modelId)),
  "anthropic-chat": () => text(anthropic(modelId)),
  "anthropic-stream": () => stream(anthropic(modelId)),
  "anthropic-structured": () => structured(anthropic(modelId)),
  "anthropic-tools": () => toolLoop(anthropic(modelId)),
};

const names = process.argv.slice(2);
for (const name of names.length ? names : Object.keys(cells)) {
  const run = cells[name];
  let line;
  try {
    if (!run) throw new Error(`no cell named ${name}`);
    line = { cell: name, ok: true, ...(await run()) };
  } catch (error) {
    line = { cell: name, ok: false, error: String(error?.stack ?? error).slice(0, 2000) };
  }
  process.stdout.write(JSON.stringify(line) + "\n");
}
