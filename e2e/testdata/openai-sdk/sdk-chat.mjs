// One chat through the official openai Node SDK, for the e2e tests that
// need a real client (TLS, tools). Install the SDK beside this file once:
//   npm install --no-save --no-package-lock --prefix e2e/testdata/openai-sdk openai@6
// Usage: node sdk-chat.mjs BASE_URL [plain|tools]
// (NODE_EXTRA_CA_CERTS names a private CA; OPENAI_API_KEY a key.)
// Prints one JSON object: {text, stream} or {tool_calls, finish_reason}.
import OpenAI from 'openai';

const [base, mode = 'plain'] = process.argv.slice(2);
const client = new OpenAI({ baseURL: base + '/v1', apiKey: process.env.OPENAI_API_KEY || 'none', maxRetries: 0, timeout: 60000 });
const model = 'gocoder-6m';
const out = {};
if (mode === 'tools') {
  const r = await client.chat.completions.create({
    model, max_tokens: 64, temperature: 0,
    messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
    tools: [{ type: 'function', function: { name: 'get_weather', description: 'Current weather of a city',
      parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 16 } }, required: ['city'] } } }],
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
  });
  out.tool_calls = r.choices[0].message.tool_calls;
  out.finish_reason = r.choices[0].finish_reason;
} else {
  const messages = [{ role: 'user', content: 'Write a Go function that adds two ints.' }];
  const r = await client.chat.completions.create({ model, messages, max_tokens: 16, temperature: 0 });
  out.text = r.choices[0].message.content;
  const s = await client.chat.completions.create({ model, messages, max_tokens: 16, temperature: 0, stream: true });
  out.stream = '';
  for await (const c of s) out.stream += c.choices[0]?.delta?.content ?? '';
}
console.log(JSON.stringify(out));
