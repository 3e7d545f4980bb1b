// Records the request bodies the official SDKs send (run once at development
// time, not in CI): npm install openai@6 @ai-sdk/openai-compatible ai in a
// scratch directory, then node record.mjs e2e/testdata/openai-sdk.
import http from 'node:http';
import fs from 'node:fs';
import OpenAI from 'openai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { generateText } from 'ai';

const out = process.argv[2];
fs.mkdirSync(out, { recursive: true });
let current = null;
const server = http.createServer((req, res) => {
  let b = '';
  req.on('data', (c) => (b += c));
  req.on('end', () => {
    const body = JSON.parse(b);
    current.recorded = { method: req.method, path: req.url, content_type: req.headers['content-type'], accept: req.headers['accept'], body };
    const chat = req.url.endsWith('/chat/completions');
    if (body.stream) {
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      const chunk = chat
        ? { id: 'x', object: 'chat.completion.chunk', created: 1, model: body.model, choices: [{ index: 0, delta: { role: 'assistant', content: 'hi' }, finish_reason: null }] }
        : { id: 'x', object: 'text_completion', created: 1, model: body.model, choices: [{ index: 0, text: 'hi', finish_reason: null }] };
      res.write('data: ' + JSON.stringify(chunk) + '\n\n');
      res.end('data: [DONE]\n\n');
      return;
    }
    res.writeHead(200, { 'content-type': 'application/json' });
    const choice = chat ? { index: 0, message: { role: 'assistant', content: 'hi' }, finish_reason: 'stop', logprobs: null } : { index: 0, text: 'hi', finish_reason: 'stop', logprobs: null };
    res.end(JSON.stringify({ id: 'x', object: chat ? 'chat.completion' : 'text_completion', created: 1, model: body.model, choices: [choice], usage: { prompt_tokens: 1, completion_tokens: 1, total_tokens: 2 } }));
  });
});
await new Promise((r) => server.listen(0, '127.0.0.1', r));
const base = `http://127.0.0.1:${server.address().port}/v1`;
const client = new OpenAI({ baseURL: base, apiKey: 'none' });
const model = 'gocoder-6m';
const msgs = [{ role: 'system', content: 'You write Go.' }, { role: 'user', content: 'Write a loop.' }];
const cases = {
  'chat': () => client.chat.completions.create({ model, messages: msgs, max_tokens: 8, temperature: 0 }),
  'chat-stream-usage': async () => { const s = await client.chat.completions.create({ model, messages: msgs, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } }); for await (const _ of s) {} },
  'chat-n': () => client.chat.completions.create({ model, messages: msgs, max_completion_tokens: 6, n: 2, seed: 11, temperature: 0.9 }),
  'chat-logprobs': () => client.chat.completions.create({ model, messages: msgs, max_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 3 }),
  'chat-logprobs-stream': async () => { const s = await client.chat.completions.create({ model, messages: msgs, max_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 2, stream: true }); for await (const _ of s) {} },
  'chat-penalties': () => client.chat.completions.create({ model, messages: msgs, max_tokens: 10, temperature: 0, presence_penalty: 0.6, frequency_penalty: 0.9, seed: 5, stop: ['\n\n'], user: 'u1' }),
  'chat-json-object': () => client.chat.completions.create({ model, messages: msgs, max_tokens: 40, response_format: { type: 'json_object' } }),
  'chat-json-schema': () => client.chat.completions.create({ model, messages: msgs, max_tokens: 40, response_format: { type: 'json_schema', json_schema: { name: 'answer', strict: true, schema: { type: 'object', properties: { name: { type: 'string' }, count: { type: 'integer' } }, required: ['name', 'count'], additionalProperties: false } } } }),
  'chat-tools': () => client.chat.completions.create({ model, messages: msgs, max_tokens: 40, tool_choice: 'auto', tools: [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }] }),
  'chat-parts': () => client.chat.completions.create({ model, messages: [{ role: 'system', content: 'You write Go.' }, { role: 'user', content: [{ type: 'text', text: 'Write a loop.' }] }], max_tokens: 8, temperature: 0 }),
  'chat-image': () => client.chat.completions.create({ model, messages: [{ role: 'user', content: [{ type: 'text', text: 'What is this?' }, { type: 'image_url', image_url: { url: 'data:image/png;base64,iVBORw0KGgo=' } }] }], max_tokens: 8 }),
  'completions': () => client.completions.create({ model, prompt: 'package main\n', max_tokens: 8, temperature: 0 }),
  'completions-stream': async () => { const s = await client.completions.create({ model, prompt: 'package main\n', max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } }); for await (const _ of s) {} },
  'completions-batch-echo': () => client.completions.create({ model, prompt: ['package main\n', 'func main() {'], max_tokens: 4, temperature: 0, echo: true, n: 2 }),
  'completions-logprobs': () => client.completions.create({ model, prompt: 'package main\n', max_tokens: 4, temperature: 0, logprobs: 3 }),
  'completions-ids': () => client.completions.create({ model, prompt: [0, 1061, 4058, 378, 855, 943], max_tokens: 4, temperature: 0 }),
};
for (const [name, fn] of Object.entries(cases)) {
  current = { name };
  await fn();
  fs.writeFileSync(`${out}/${name}.json`, JSON.stringify({ sdk: 'openai@6.49.0', ...current.recorded }, null, 2) + '\n');
}
// Vercel AI SDK: a user message of two text parts.
const provider = createOpenAICompatible({ name: 'meshgpu', baseURL: base });
for (const [name, content] of [['vercel-parts', [{ type: 'text', text: 'Write a loop.' }, { type: 'text', text: 'In Go.' }]], ['vercel-string', 'Write a loop.\nIn Go.']]) {
  current = { name };
  await generateText({ model: provider(model), messages: [{ role: 'system', content: 'You write Go.' }, { role: 'user', content }], maxOutputTokens: 8, temperature: 0 });
  const v = JSON.parse(fs.readFileSync('node_modules/ai/package.json')).version;
  fs.writeFileSync(`${out}/${name}.json`, JSON.stringify({ sdk: `ai@${v} @ai-sdk/openai-compatible`, ...current.recorded }, null, 2) + '\n');
}
server.close();
