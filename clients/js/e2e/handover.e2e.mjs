// The client in Node follows a drain hand-over: a resumable text session behind the router,
// its replica drained (SIGTERM, by the test), the session resumed on another replica.
//
//   RT_URL=ws://127.0.0.1:8080/v1/realtime?session_key=k RT_KEY=... RT_OPEN='{...}' \
//   RT_FACT="..." RT_QUESTION="..." node clients/js/e2e/handover.e2e.mjs
//
// Prints `{"told": <session id>}` once the fact is answered, then waits for the test to drain
// that replica; once the session moved (event "resumed" or "reopened"), asks the question and
// prints one JSON summary line (what tests/scale_out/test_drain_handover_clients.py checks).
import { WebSocket } from "ws";

import { RealtimeClient } from "../realtime-client.js";

const env = process.env;
const client = await RealtimeClient.connect(env.RT_URL, { apiKey: env.RT_KEY, WebSocket, timeoutMs: 180000 });
const moved = new Promise((resolve) => {
  client.on("resumed", (e) => resolve({ how: "resumed", event: e }));
  client.on("reopened", (e) => resolve({ how: "reopened", event: e }));
});
const drains = [];
client.on("server.draining", (e) => drains.push(e));
const opened = await client.open(JSON.parse(env.RT_OPEN));
const told = await client.appendText(env.RT_FACT);
console.log(JSON.stringify({ told: opened.session_id, status: told.status }));

const { how, event } = await moved;
const answer = await client.appendText(env.RT_QUESTION);
await client.close();
console.log(
  JSON.stringify({
    how,
    opened: opened.session_id,
    sessionId: client.sessionId,
    generation: client.generation,
    resumes: client.resumes,
    drains,
    rebuilt: event.rebuilt ?? null,
    reprefilled: event.reprefilled_tokens ?? null,
    answer: { text: answer.text, status: answer.status, frame_index: answer.frame_index },
  }),
);
