// Compiled with `tsc -p test/tsconfig.json` (no output): the declarations describe the API.
import RealtimeClientDefault, {
  RealtimeClient,
  RealtimeError,
  type ResponseDoneEvent,
  ResponseStream,
  type ErrorCode,
  type ServerEvent,
  sniffMedia,
  ClientMachine,
  PROTOCOL_TABLES,
  type SessionState,
} from "../realtime-client.js";

export function machine(client: RealtimeClient): SessionState {
  const own = new ClientMachine(PROTOCOL_TABLES);
  own.send({ type: "session.open", event_id: "e1" });
  const next: number = client.machine.nextFrameIndex;
  console.log(next, own.busy, own.unanswered[0]?.input);
  return client.machine.state;
}

export async function demo(url: string, jpeg: Blob): Promise<number | null> {
  const client: RealtimeClient = await RealtimeClient.connect(url, { apiKey: "k", timeoutMs: 5000 });
  const opened = await client.open({ instructions: "hi", retention: { window_chunks: 4 }, sampling: { max_tokens: 8 } });
  const model: string | null = opened.config.model;
  // Generated from protocol/: the echo has every field, limits and reservation included.
  const clipCap: number | null = opened.limits.max_clip_frames;
  const reserved: number | undefined = opened.reservation?.kv_blocks;
  const code: ErrorCode = "capacity_exceeded";
  console.log(clipCap, reserved, code, opened.config.retention.window_chunks);
  const off = client.on("response.text.delta", (event) => console.log(event.delta.length));
  client.on("event", (event: ServerEvent) => {
    if (event.type === "response.done") console.log(event.retention.kv_blocks_held);
  });
  const done: ResponseDoneEvent = await client.appendFrame(jpeg, {
    prompt: "what?",
    onDelta: (delta, text) => console.log(delta, text),
  });
  const offered = await client.offerFrame(() => jpeg, { binary: false });
  off();
  try {
    await client.appendText("x");
  } catch (err) {
    if (err instanceof RealtimeError && err.code === "chunk_in_flight") console.log(err.sessionSurvives);
  }
  const resilient = await RealtimeClient.connect(url, { maxRetries: 3, retryBackoffMs: 100 });
  const again = await resilient.open({ resumable: { grace_s: 30 } });
  const token: string | null = again.resume_token;
  resilient.on("resumed", (event) => console.log(event.next_frame_index, event.missed_response?.text));
  resilient.on("reopened", (event) => console.log(event.session_id, resilient.generation));
  resilient.on("server.draining", (event) => console.log(event.seconds_left, resilient.holding));
  console.log(token, resilient.resilient, resilient.resumes, resilient.draining?.seconds_left);
  await client.open({
    modality: "video",
    retention: { window_chunks: 4, text_window_tokens: 256 },
    sampling: { response_format: { type: "json_schema", json_schema: { name: "scene", schema: { type: "object" } } } },
  });
  const watched = await client.ingestFrame(new Uint8Array(4), { frameId: "w" });
  const status: "ingested" | "completed" | "cancelled" | "failed" | "incomplete" = watched.status;
  const answer = await client.ask("What changed?", { responseFormat: { type: "json_object" }, onDelta: (d) => console.log(d) });
  console.log(status, answer.text);
  // Async iterators: a reply's deltas, then its response.done; every server event.
  const stream: ResponseStream = client.streamFrame(jpeg, { prompt: "what?", responseFormat: { type: "json_object" } });
  for await (const delta of stream) console.log(delta.delta.length, delta.frame_index, stream.text);
  const streamed: ResponseDoneEvent | null = stream.done;
  const asked: ResponseDoneEvent = await client.streamAsk("and now?").result();
  for await (const delta of client.streamText("hi")) console.log(delta.delta);
  for await (const event of client.events()) {
    if (event.type === "response.done") console.log(event.text, streamed?.text, asked.status);
    if (event.type === "session.closed") break;
  }
  for await (const event of client) console.log(event.type);
  const inNode = await RealtimeClient.connect(url, { apiKey: "k", apiKeyIn: "header" });
  const where: "header" | "subprotocol" = inNode.apiKeyIn;
  console.log(where);
  const updated = await client.update({ sampling: { temperature: 0.7 } });
  const temperature: number = updated.config.sampling.temperature;
  console.log(temperature);
  const closed = await client.close({ timeoutMs: 100 });
  console.log(model, closed?.reason, offered?.status, sniffMedia(new Uint8Array(4)), RealtimeClientDefault);
  return done.timing.total_ms;
}
