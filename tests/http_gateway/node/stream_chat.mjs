// One streamed chat completion with logprobs through the official `openai` Node SDK, unmodified.
// Env: GATEWAY_BASE_URL (".../v1"), GATEWAY_MODEL; optional PROMPT, MAX_TOKENS.
// Prints one JSON line: {content, entries, finish_reason, chunks, usage}.
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.GATEWAY_BASE_URL,
  apiKey: process.env.GATEWAY_API_KEY || "unused",
  maxRetries: 0,
  timeout: 60_000,
});

const stream = await client.chat.completions.create({
  model: process.env.GATEWAY_MODEL,
  messages: [{ role: "user", content: process.env.PROMPT || "Say hello." }],
  max_tokens: Number(process.env.MAX_TOKENS || 8),
  temperature: 0,
  logprobs: true,
  top_logprobs: 2,
  stream: true,
  stream_options: { include_usage: true },
});

let content = "";
const entries = [];
let finish_reason = null;
let usage = null;
let chunks = 0;
for await (const chunk of stream) {
  chunks += 1;
  if (chunk.usage) usage = chunk.usage;
  for (const choice of chunk.choices) {
    content += choice.delta?.content ?? "";
    if (choice.logprobs?.content) entries.push(...choice.logprobs.content);
    if (choice.finish_reason) finish_reason = choice.finish_reason;
  }
}
console.log(JSON.stringify({ content, entries, finish_reason, chunks, usage }));
