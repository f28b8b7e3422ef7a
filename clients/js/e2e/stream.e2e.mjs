// The client in Node against a real server: the API key in a header, a reply's deltas through
// `for await`, every server event through client.events().
//
//   RT_URL=ws://127.0.0.1:8000/v1/realtime RT_KEY=... RT_JPEG=frame.jpg RT_IMPL=ws|node \
//   node clients/js/e2e/stream.e2e.mjs
//
// RT_IMPL=ws: the `ws` package; RT_IMPL=node: Node's own WebSocket (global from Node 22; Node 20
// needs --experimental-websocket). Prints one JSON line (what the pytest test checks).
import { readFile } from "node:fs/promises";

import { RealtimeClient } from "../realtime-client.js";

const env = process.env;
const Base = env.RT_IMPL === "ws" ? (await import("ws")).WebSocket : globalThis.WebSocket;
if (typeof Base !== "function") throw new Error(`no WebSocket implementation for RT_IMPL=${env.RT_IMPL}`);

// Record how the client builds each socket (a subclass keeps the implementation's own form).
const handshakes = [];
class Recording extends Base {
  constructor(...args) {
    super(...args);
    handshakes.push(JSON.parse(JSON.stringify(args)));
  }
}

const options = { WebSocket: Recording, timeoutMs: 120000 };
const summary = { impl: env.RT_IMPL, handshakes };

// A wrong key is refused in the handshake (the header reached the server).
try {
  await RealtimeClient.connect(env.RT_URL, { ...options, apiKey: "not-the-key" });
  summary.wrongKey = "accepted";
} catch (err) {
  summary.wrongKey = err.code;
}

const jpeg = await readFile(env.RT_JPEG);
const client = await RealtimeClient.connect(env.RT_URL, { ...options, apiKey: env.RT_KEY });
summary.apiKeyIn = client.apiKeyIn;
summary.protocol = client._ws.protocol;
const events = [];
const reading = (async () => {
  for await (const event of client.events()) events.push(event);
})();
await client.open({ instructions: "Describe each frame.", retention: { window_chunks: 4 }, sampling: { max_tokens: 8 } });

const stream = client.streamFrame(jpeg, { prompt: "What do you see?", frameId: "f0" });
const deltas = [];
for await (const delta of stream) deltas.push({ type: delta.type, frame_index: delta.frame_index, delta: delta.delta });
summary.deltas = deltas;
summary.streamText = stream.text;
summary.done = stream.done;

// One chunk in flight: a second stream's loop throws at once; the first finishes.
const first = client.streamFrame(jpeg, { binary: false });
const firstStep = first.next();
try {
  for await (const _ of client.streamAsk("And now?")) summary.second = "yielded";
} catch (err) {
  summary.inFlight = { code: err.code, local: err.local };
}
await firstStep;
summary.firstDone = (await first.result()).status;
summary.answer = await client.streamAsk("What colour?").result();

summary.closed = (await client.close()).reason;
await reading; // ends with the session
summary.events = events.map((e) => ({ type: e.type, frame_index: e.frame_index ?? null, delta: e.delta ?? null }));
console.log(JSON.stringify(summary));
