// The tutorial loop of the Node `openai` package against the gateway, as its users write it:
// `for await (const chunk of stream) chunk.choices[0].delta.content`. Prints one JSON line
// per stream: the text of each choice and the usage of every chunk (null where none).
// Usage: node stream_usage.mjs <base_url> <api_key> <stream_options JSON or "absent">
import OpenAI from "openai";

const [baseURL, apiKey, optionsArg] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30000 });
const extra = optionsArg === "absent" ? {} : { stream_options: JSON.parse(optionsArg) };
const guarded = optionsArg !== "absent" && JSON.parse(optionsArg).include_usage === true;

async function run(kind) {
  const common = { model: "m1", max_tokens: 3, stream: true, ...extra };
  const stream =
    kind === "chat"
      ? await client.chat.completions.create({
          ...common,
          messages: [{ role: "user", content: "one two three" }],
        })
      : await client.completions.create({ ...common, prompt: "one two three" });
  let text = "";
  const usage = [];
  for await (const chunk of stream) {
    usage.push(chunk.usage ?? null);
    if (guarded && chunk.choices.length === 0) continue;
    // A TypeError here (choices[0] undefined) is what the test guards against.
    text += kind === "chat" ? chunk.choices[0].delta.content ?? "" : chunk.choices[0].text;
  }
  return { kind, text, usage };
}

for (const kind of ["chat", "completions"]) {
  console.log(JSON.stringify(await run(kind)));
}
