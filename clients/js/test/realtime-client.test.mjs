// Unit tests of realtime-client.js against a tiny fake WebSocket (node --test).
import assert from "node:assert/strict";
import { test } from "node:test";

import { AUTH_SUBPROTOCOL_PREFIX, RealtimeClient, RealtimeError, ResponseStream, SUBPROTOCOL, sniffMedia } from "../realtime-client.js";

const JPEG = new Uint8Array([0xff, 0xd8, 0xff, 0xe0, 1, 2, 3, 4, 0xff, 0xd9]);
const LIMITS = {
  max_frame_bytes: 64,
  max_event_bytes: 1024,
  max_sessions: 1,
  idle_timeout_s: 60,
  max_tokens_cap: 64,
  server_version: "test",
  model: "fake",
  protocol_version: "2026-12-01",
};

/** A WebSocket double: records what the client sends; the test plays the server. */
class FakeWebSocket {
  static last = null;
  static selected = SUBPROTOCOL;

  constructor(url, protocols, options) {
    this.url = url;
    this.protocols = protocols;
    this.options = options; // the `ws` package's third argument (headers)
    this.readyState = 0;
    this.protocol = "";
    this.binaryType = "blob";
    this.sent = [];
    this.onopen = this.onmessage = this.onerror = this.onclose = null;
    FakeWebSocket.last = this;
  }

  send(data) {
    if (this.readyState !== 1) throw new Error("InvalidStateError: not open");
    this.sent.push(data);
    this.onsend?.(data);
  }

  close(code = 1000) {
    if (this.readyState >= 2) return;
    this.readyState = 2;
    queueMicrotask(() => this.serverClose(code));
  }

  // -- the server's side
  accept(protocol = FakeWebSocket.selected) {
    this.readyState = 1;
    this.protocol = protocol;
    this.onopen?.({});
  }

  emit(event) {
    this.onmessage?.({ data: JSON.stringify(event) });
  }

  serverClose(code = 1000) {
    this.readyState = 3;
    this.onclose?.({ code, reason: "" });
  }

  json() {
    return this.sent.filter((m) => typeof m === "string").map((m) => JSON.parse(m));
  }

  lastJson() {
    const all = this.json();
    return all[all.length - 1];
  }
}

const tick = () => new Promise((resolve) => setImmediate(resolve));

async function connected(options = {}) {
  const pending = RealtimeClient.connect("ws://test/v1/realtime", { WebSocket: FakeWebSocket, ...options });
  const ws = FakeWebSocket.last;
  ws.accept();
  ws.emit({ type: "session.created", event_id: "evt_1", session_id: "sess_1", limits: LIMITS });
  const client = await pending;
  return { client, ws };
}

async function opened(options = {}) {
  const { client, ws } = await connected(options);
  const open = client.open({ instructions: "hi", sampling: { max_tokens: 8 } });
  const sent = ws.lastJson();
  ws.emit({ type: "session.opened", event_id: "evt_2", session_id: "sess_1", config: { instructions: "hi" }, limits: LIMITS });
  await open;
  return { client, ws, openEvent: sent };
}

let frameIndex = 0;
/** Answer the last frame.append the way the server does: ack, created, deltas, done. */
function reply(ws, { deltas = ["a ", "cat"], status = "completed", frameId = null, ack = true } = {}) {
  const index = frameIndex++;
  if (ack) ws.emit({ type: "input.ack", event_id: "e", frame_index: index, frame_id: frameId, bytes: 10 });
  ws.emit({ type: "response.created", event_id: "e", frame_index: index, frame_id: frameId });
  for (const delta of deltas) ws.emit({ type: "response.text.delta", event_id: "e", frame_index: index, delta });
  ws.emit({
    type: "response.done",
    event_id: "e",
    frame_index: index,
    frame_id: frameId,
    status,
    status_reason: null,
    text: deltas.join(""),
    usage: { prompt_tokens: 20, completion_tokens: deltas.length },
    timing: { queue_ms: 1, ttft_ms: 2, total_ms: 3 },
    retention: { frames_retained: 1, frames_evicted: 0, tokens_retained: 20, kv_blocks_held: 2, consolidations: 0 },
    some_future_field: 1,
  });
  return index;
}

test("apiKeyIn: subprotocol offers vllm-realtime and the auth subprotocol, resolves on session.created", async () => {
  const { client, ws } = await connected({ apiKey: "k3y", apiKeyIn: "subprotocol" });
  assert.deepEqual(ws.protocols, [SUBPROTOCOL, AUTH_SUBPROTOCOL_PREFIX + "k3y"]);
  assert.equal(ws.options, undefined);
  assert.equal(ws.binaryType, "arraybuffer");
  assert.equal(client.sessionId, "sess_1");
  assert.equal(client.limits.max_frame_bytes, 64);
  assert.equal(client.busy, false);
});

test("in Node the key goes in an Authorization header, out of the subprotocols (the `ws` package's form)", async () => {
  const { client, ws } = await connected({ apiKey: "k3y" });
  assert.equal(client.apiKeyIn, "header");
  assert.deepEqual(ws.protocols, [SUBPROTOCOL]);
  assert.deepEqual(ws.options, { headers: { Authorization: "Bearer k3y" } });
});

test("Node's own WebSocket (or a subclass) gets the key in its WebSocketInit", async () => {
  const saved = globalThis.WebSocket;
  class NodeWebSocket extends FakeWebSocket {}
  globalThis.WebSocket = NodeWebSocket;
  try {
    for (const WS of [NodeWebSocket, class extends NodeWebSocket {}]) {
      const pending = RealtimeClient.connect("ws://test/v1/realtime", { apiKey: "k3y", WebSocket: WS });
      const ws = FakeWebSocket.last;
      assert.deepEqual(ws.protocols, { protocols: [SUBPROTOCOL], headers: { Authorization: "Bearer k3y" } });
      assert.equal(ws.options, undefined);
      ws.accept();
      ws.emit({ type: "session.created", event_id: "evt_1", session_id: "sess_1", limits: LIMITS });
      await pending;
    }
  } finally {
    globalThis.WebSocket = saved;
  }
  assert.throws(() => new RealtimeClient("ws://x", { WebSocket: FakeWebSocket, apiKeyIn: "query" }), TypeError);
});

test("without a key only vllm-realtime is offered", async () => {
  const { ws } = await connected();
  assert.deepEqual(ws.protocols, [SUBPROTOCOL]);
});

test("no WebSocket implementation is a clear TypeError", () => {
  assert.throws(() => new RealtimeClient("ws://x", { WebSocket: undefined }), /no WebSocket implementation/);
});

test("a socket closed before session.created rejects connect (handshake refusals look like this)", async () => {
  const pending = RealtimeClient.connect("ws://test", { WebSocket: FakeWebSocket });
  FakeWebSocket.last.serverClose(1006);
  await assert.rejects(pending, (err) => err instanceof RealtimeError && err.code === "connection_failed" && /API key/.test(err.message));
});

test("a server that selects another subprotocol is refused", async () => {
  const pending = RealtimeClient.connect("ws://test", { WebSocket: FakeWebSocket });
  FakeWebSocket.last.accept("something-else");
  await assert.rejects(pending, (err) => err.code === "connection_failed");
});

test("open sends session.open with an event_id and resolves with session.opened", async () => {
  const { client, openEvent } = await opened();
  assert.equal(openEvent.type, "session.open");
  assert.equal(openEvent.instructions, "hi");
  assert.deepEqual(openEvent.sampling, { max_tokens: 8 });
  assert.match(openEvent.event_id, /^js-\d+$/);
  assert.equal(client.config.instructions, "hi");
  await assert.rejects(client.open(), (err) => err.code === "session_already_open" && err.local);
});

test("open rejects with the server's error matched by event_id (capacity_exceeded)", async () => {
  const { client, ws } = await connected();
  const open = client.open();
  const { event_id } = ws.lastJson();
  ws.emit({ type: "error", event_id: "e", error: { type: "capacity_error", code: "capacity_exceeded", message: "full", event_id, session_survives: true } });
  await assert.rejects(open, (err) => err instanceof RealtimeError && err.code === "capacity_exceeded" && err.sessionSurvives && !err.local);
  assert.equal(client.closed, false);
});

test("frames before open are refused locally", async () => {
  const { client, ws } = await connected();
  await assert.rejects(client.appendFrame(JPEG), (err) => err.code === "session_not_open" && err.local);
  assert.equal(ws.json().length, 0);
});

test("appendFrame sends the announcement then the bytes, streams deltas, resolves with response.done", async () => {
  const { client, ws } = await opened();
  const deltas = [];
  const pending = client.appendFrame(JPEG, { prompt: "what?", frameId: "f1", timestamp: 1.5, onDelta: (d, text) => deltas.push([d, text]) });
  await tick();
  assert.equal(client.busy, true);
  const announce = ws.lastJson();
  assert.deepEqual(
    { type: announce.type, binary: announce.binary, prompt: announce.prompt, frame_id: announce.frame_id, timestamp: announce.timestamp },
    { type: "frame.append", binary: true, prompt: "what?", frame_id: "f1", timestamp: 1.5 },
  );
  assert.equal("image" in announce, false);
  const last = ws.sent[ws.sent.length - 1];
  assert.ok(last instanceof Uint8Array, "the payload is the next (binary) message");
  assert.deepEqual([...last], [...JPEG]);
  reply(ws, { frameId: "f1" });
  const done = await pending;
  assert.equal(done.type, "response.done");
  assert.equal(done.text, "a cat");
  assert.equal(done.retention.kv_blocks_held, 2);
  assert.deepEqual(deltas, [["a ", "a "], ["cat", "a cat"]]);
  assert.equal(client.busy, false);
  assert.equal(client.stats.framesSent, 1);
  assert.equal(client.stats.replies, 1);
});

test("one chunk in flight: a second appendFrame is refused locally, nothing is sent", async () => {
  const { client, ws } = await opened();
  const first = client.appendFrame(JPEG);
  await tick();
  const sentBefore = ws.sent.length;
  await assert.rejects(client.appendFrame(JPEG), (err) => err.code === "chunk_in_flight" && err.local);
  assert.equal(ws.sent.length, sentBefore);
  reply(ws);
  await first;
  const second = client.appendFrame(JPEG);
  await tick();
  reply(ws);
  await second;
});

test("offerFrame paces a live source: drops (and counts) frames while busy, never queues", async () => {
  const { client, ws } = await opened();
  let made = 0;
  const factory = () => {
    made += 1;
    return new Blob([JPEG]);
  };
  const first = client.offerFrame(factory);
  assert.equal(client.busy, true, "busy from the moment a frame is being prepared");
  assert.equal(await client.offerFrame(factory), null);
  await tick();
  assert.equal(await client.offerFrame(factory), null);
  assert.equal(made, 1, "the factory runs only for frames that are sent");
  assert.equal(client.stats.dropped, 2);
  assert.equal(ws.json().filter((e) => e.type === "frame.append").length, 1);
  reply(ws);
  assert.equal((await first).status, "completed");
  const again = client.offerFrame(factory);
  await tick();
  reply(ws);
  assert.equal((await again).type, "response.done");
  assert.equal(made, 2);
});

test("binary: false sends base64 in the event; clips go in `video`; strings go as `image`", async () => {
  const { client, ws } = await opened();
  let pending = client.appendFrame(JPEG.buffer, { binary: false });
  await tick();
  assert.equal(ws.lastJson().image, Buffer.from(JPEG).toString("base64"));
  reply(ws);
  await pending;
  const mp4 = new Uint8Array([0, 0, 0, 0x18, 0x66, 0x74, 0x79, 0x70, 1, 2]);
  pending = client.appendFrame(mp4, { binary: false });
  await tick();
  assert.equal(ws.lastJson().video, Buffer.from(mp4).toString("base64"));
  reply(ws);
  await pending;
  pending = client.appendFrame("data:image/jpeg;base64,/9j/AA==");
  await tick();
  assert.equal(ws.lastJson().image, "data:image/jpeg;base64,/9j/AA==");
  reply(ws);
  await pending;
});

test("payloads are checked locally: format and size", async () => {
  const { client, ws } = await opened();
  const before = ws.sent.length;
  await assert.rejects(client.appendFrame(new Uint8Array([1, 2, 3, 4])), (err) => err.code === "undecodable_frame" && err.local);
  const big = new Uint8Array(65);
  big.set([0xff, 0xd8, 0xff]);
  await assert.rejects(client.appendFrame(big), (err) => err.code === "frame_too_large");
  await assert.rejects(client.appendFrame(42), TypeError);
  assert.equal(ws.sent.length, before);
  assert.equal(client.busy, false);
});

test("a refusal before input.ack rejects that frame with the server's code; the session lives", async () => {
  const { client, ws } = await opened();
  const pending = client.appendFrame(JPEG);
  await tick();
  const { event_id } = ws.json().filter((e) => e.type === "frame.append").pop();
  ws.emit({ type: "error", event_id: "e", error: { type: "invalid_request_error", code: "undecodable_frame", message: "bad", event_id, session_survives: true, param: "image" } });
  await assert.rejects(
    pending,
    (err) => err.code === "undecodable_frame" && err.eventId === event_id && err.sessionSurvives && err.param === "image",
  );
  assert.equal(client.busy, false);
  assert.equal(client.closed, false);
  const next = client.appendFrame(JPEG);
  await tick();
  reply(ws);
  await next;
});

test("an error answering nothing pending is kept in client.errors", async () => {
  const { client, ws } = await opened();
  ws.emit({ type: "error", event_id: "e", error: { type: "invalid_request_error", code: "undecodable_frame", message: "late", event_id: "js-999", session_survives: true } });
  assert.equal(client.errors.length, 1);
  assert.equal(client.errors[0].code, "undecodable_frame");
});

test("a fatal error ends the session; the accepted chunk still gets its response.done", async () => {
  const { client, ws } = await opened();
  const pending = client.appendFrame(JPEG);
  await tick();
  ws.emit({ type: "input.ack", event_id: "e", frame_index: frameIndex, frame_id: null, bytes: 10 });
  ws.emit({ type: "error", event_id: "e", error: { type: "server_error", code: "engine_error", message: "boom", event_id: null, session_survives: false } });
  assert.equal(client.closed, true);
  assert.equal(client.busy, true, "still waiting for the drained response.done");
  ws.emit({
    type: "response.done", event_id: "e", frame_index: frameIndex++, frame_id: null, status: "failed", status_reason: "engine_error",
    text: "", usage: { prompt_tokens: 0, completion_tokens: 0 }, timing: { queue_ms: null, ttft_ms: null, total_ms: 1 },
    retention: { frames_retained: 0, frames_evicted: 0, tokens_retained: 0, kv_blocks_held: 0, consolidations: 0 },
  });
  assert.equal((await pending).status, "failed");
  ws.emit({ type: "session.closed", event_id: "e", session_id: "sess_1", reason: "engine_error", frames_total: 1 });
  ws.serverClose(1000);
  await assert.rejects(client.appendFrame(JPEG), (err) => err.code === "engine_error" && !err.sessionSurvives);
  assert.equal(client.closedEvent.reason, "engine_error");
});

test("a timeout cancels the reply; the client stays busy until its response.done", async () => {
  const { client, ws } = await opened();
  const pending = client.appendFrame(JPEG, { timeoutMs: 20 });
  await assert.rejects(pending, (err) => err.code === "timeout" && err.local);
  assert.equal(ws.lastJson().type, "response.cancel");
  assert.equal(client.busy, true);
  assert.equal(await client.offerFrame(JPEG), null);
  reply(ws, { status: "cancelled" });
  assert.equal(client.busy, false);
});

test("cancel() sends response.cancel and resolves with the cancelled response.done", async () => {
  const { client, ws } = await opened();
  assert.equal(await client.cancel(), null);
  const pending = client.appendFrame(JPEG);
  await tick();
  const cancelled = client.cancel();
  const cancel = ws.lastJson();
  assert.equal(cancel.type, "response.cancel");
  reply(ws, { status: "cancelled", deltas: [] });
  assert.equal((await cancelled).status, "cancelled");
  assert.equal((await pending).status, "cancelled");
  // The reply may have finished first: the server's no_response_in_flight is not an error to keep.
  ws.emit({ type: "error", event_id: "e", error: { type: "invalid_request_error", code: "no_response_in_flight", message: "none", event_id: cancel.event_id, session_survives: true } });
  assert.equal(client.errors.length, 0);
});

test("appendText sends a text turn", async () => {
  const { client, ws } = await opened();
  const pending = client.appendText("And now?", { prompt: "p" });
  assert.deepEqual(
    (({ type, text, prompt }) => ({ type, text, prompt }))(ws.lastJson()),
    { type: "frame.append", text: "And now?", prompt: "p" },
  );
  reply(ws);
  assert.equal((await pending).text, "a cat");
});

test("close() sends session.close, resolves with session.closed, closes the socket", async () => {
  const { client, ws } = await opened();
  const closing = client.close();
  const sent = ws.lastJson();
  assert.equal(sent.type, "session.close");
  ws.emit({ type: "session.closed", event_id: "e", session_id: "sess_1", reason: "client_closed", frames_total: 0 });
  ws.serverClose(1000);
  const closed = await closing;
  assert.equal(closed.reason, "client_closed");
  assert.equal(client.closed, true);
  assert.equal(await client.close(), closed, "twice is harmless");
  await assert.rejects(client.appendFrame(JPEG), (err) => err.code === "session_closed");
});

test("close() gives up waiting after timeoutMs and closes the socket itself", async () => {
  const { client, ws } = await opened();
  await client.close({ timeoutMs: 10 });
  assert.equal(ws.readyState, 3);
});

test("a dropped socket fails the reply in flight with connection_lost", async () => {
  const { client, ws } = await opened();
  const seen = [];
  client.on("close", (info) => seen.push(info.code));
  const pending = client.appendFrame(JPEG);
  await tick();
  ws.serverClose(1006);
  await assert.rejects(pending, (err) => err.code === "connection_lost");
  assert.deepEqual(seen, [1006]);
  assert.equal(client.closed, true);
});

test("listeners get events by type and all events; unknown event types are ignored", async () => {
  const seen = [];
  const { client, ws } = await opened({ onEvent: (e) => seen.push(e.type) });
  const deltas = [];
  const off = client.on("response.text.delta", (e) => deltas.push(e.delta));
  ws.emit({ type: "server.future_event", event_id: "e" });
  ws.onmessage({ data: "not json" });
  const pending = client.appendFrame(JPEG);
  await tick();
  reply(ws);
  await pending;
  off();
  assert.deepEqual(deltas, ["a ", "cat"]);
  assert.ok(seen.includes("session.created") && seen.includes("response.done") && seen.includes("server.future_event"));
});

test("sniffMedia knows the server's formats", () => {
  assert.equal(sniffMedia(JPEG), "jpeg");
  assert.equal(sniffMedia(new Uint8Array([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])), "png");
  assert.equal(sniffMedia(new TextEncoder().encode("RIFF\0\0\0\0WEBPVP8 ")), "webp");
  assert.equal(sniffMedia(new Uint8Array([0x1a, 0x45, 0xdf, 0xa3])), "webm");
  assert.equal(sniffMedia(new Uint8Array([1, 2, 3])), null);
});

// ------------------------------------------------------------------ resilient sessions

const DONE = (index, text = "ok") => ({
  type: "response.done",
  event_id: "e",
  frame_index: index,
  frame_id: null,
  status: "completed",
  status_reason: null,
  text,
  usage: { prompt_tokens: 1, completion_tokens: 1 },
  timing: { queue_ms: 1, ttft_ms: 1, total_ms: 1 },
  retention: { frames_retained: 1, frames_evicted: 0, tokens_retained: 1, kv_blocks_held: 1, consolidations: 0 },
});

async function resilient(options = {}) {
  // A short handshake deadline: a client a test leaves reconnecting to a fake that never
  // answers gives up in seconds, not after 8 attempts of 10 s (which kept node --test alive).
  const { client, ws } = await connected({ retryBackoffMs: 1, openTimeoutMs: 500, ...options });
  const open = client.open({ resumable: { grace_s: 30 }, sampling: { max_tokens: 8 } });
  ws.emit({
    type: "session.opened",
    event_id: "evt_2",
    session_id: "sess_r",
    config: { resumable: { grace_s: 30 }, sampling: { max_tokens: 8 } },
    limits: LIMITS,
    resume_token: "tok-1",
  });
  await open;
  return { client, ws };
}

/** Wait until the client dialled a new socket, accept it and greet. */
async function nextSocket(previous) {
  for (let i = 0; i < 200 && FakeWebSocket.last === previous; i += 1) await new Promise((r) => setTimeout(r, 1));
  const ws = FakeWebSocket.last;
  assert.notEqual(ws, previous, "the client did not reconnect");
  ws.accept();
  ws.emit({ type: "session.created", event_id: "evt_9", session_id: "sess_tmp", limits: LIMITS });
  await tick();
  return ws;
}

/** The server's session.resumed for "sess_r" on `ws`: nothing missed, the token rotated. */
function emitResumed(ws, fields = {}) {
  ws.emit({
    type: "session.resumed",
    event_id: "e",
    session_id: "sess_r",
    config: {},
    limits: LIMITS,
    next_frame_index: 0,
    in_flight_frame_index: null,
    missed_response: null,
    resume_token: "tok-2",
    ...fields,
  });
}

test("resilient: a drop mid-reply is resumed and the missed response.done resolves the call", async () => {
  const { client, ws } = await resilient();
  assert.equal(client.resilient, true);
  const pending = client.appendFrame(JPEG);
  await tick();
  ws.emit({ type: "input.ack", event_id: "e", frame_index: 0, frame_id: null, bytes: 10 });
  ws.serverClose(1006);
  assert.equal(client.holding, true);
  assert.equal(client.closed, false);
  const ws2 = await nextSocket(ws);
  assert.deepEqual(ws2.lastJson(), { type: "session.resume", event_id: ws2.lastJson().event_id, session_id: "sess_r", resume_token: "tok-1" });
  const resumedEvents = [];
  client.on("resumed", (e) => resumedEvents.push(e));
  emitResumed(ws2, {
    config: { resumable: { grace_s: 30 } },
    next_frame_index: 1,
    missed_response: DONE(0, "missed"),
  });
  const done = await pending;
  assert.equal(done.text, "missed");
  assert.equal(client.resumes, 1);
  assert.equal(client.generation, 1);
  assert.equal(resumedEvents.length, 1);
  assert.equal(client.holding, false);
  // The session goes on on the new socket, and the next resume uses the rotated token.
  const next = client.appendFrame(JPEG);
  await tick();
  ws2.emit({ type: "input.ack", event_id: "e", frame_index: 1, frame_id: null, bytes: 10 });
  ws2.emit(DONE(1));
  assert.equal((await next).frame_index, 1);
  ws2.serverClose(1006);
  const ws3 = await nextSocket(ws2);
  assert.equal(ws3.lastJson().resume_token, "tok-2");
});

test("resilient: a chunk the server never accepted is sent again after the resume", async () => {
  const { client, ws } = await resilient();
  const pending = client.appendFrame(JPEG, { binary: false, frameId: "f0" });
  await tick();
  ws.serverClose(1006); // before its input.ack
  const ws2 = await nextSocket(ws);
  emitResumed(ws2);
  await tick();
  const resent = ws2.lastJson();
  assert.equal(resent.type, "frame.append");
  assert.equal(resent.frame_id, "f0");
  ws2.emit({ type: "input.ack", event_id: "e", frame_index: 0, frame_id: "f0", bytes: 10 });
  ws2.emit(DONE(0));
  assert.equal((await pending).frame_index, 0);
});

test("resilient: server.draining holds new frames; after the reply a new session opens", async () => {
  const { client, ws } = await resilient();
  const pending = client.appendFrame(JPEG);
  await tick();
  ws.emit({ type: "input.ack", event_id: "e", frame_index: 0, frame_id: null, bytes: 10 });
  ws.emit({ type: "server.draining", event_id: "e", seconds_left: 20 });
  assert.equal(await client.offerFrame(JPEG), null); // dropped while the server drains
  ws.emit(DONE(0));
  assert.equal((await pending).frame_index, 0); // the current reply finishes
  ws.emit({ type: "session.closed", event_id: "e", session_id: "sess_r", reason: "server_shutdown", frames_total: 1 });
  ws.serverClose(1000);
  assert.equal(client.closed, false);
  const ws2 = await nextSocket(ws);
  const reopen = ws2.lastJson();
  assert.equal(reopen.type, "session.open");
  assert.deepEqual(reopen.resumable, { grace_s: 30 });
  const reopened = [];
  client.on("reopened", (e) => reopened.push(e.session_id));
  ws2.emit({ type: "session.opened", event_id: "e", session_id: "sess_new", config: reopen, limits: LIMITS, resume_token: "tok-new" });
  await tick();
  assert.deepEqual(reopened, ["sess_new"]);
  assert.equal(client.sessionId, "sess_new");
  assert.equal(client.generation, 2);
  assert.equal(client.holding, false);
});

test("resilient: server.draining with handover resumes the session (not a new one)", async () => {
  const { client, ws } = await resilient();
  ws.emit({ type: "server.draining", event_id: "e", seconds_left: 20, handover: true });
  assert.equal(await client.offerFrame(JPEG), null); // held while the session moves
  ws.emit({ type: "session.closed", event_id: "e", session_id: "sess_r", reason: "server_shutdown", frames_total: 0 });
  ws.serverClose(1000);
  const ws2 = await nextSocket(ws);
  const resume = ws2.lastJson();
  // The stored session is resumed on whichever replica the reconnect reached: same id, token.
  assert.equal(resume.type, "session.resume");
  assert.equal(resume.session_id, "sess_r");
  const resumed = [];
  const reopened = [];
  client.on("resumed", (e) => resumed.push(e.session_id));
  client.on("reopened", (e) => reopened.push(e.session_id));
  emitResumed(ws2, { rebuilt: true, reprefilled_tokens: 40 });
  await tick();
  assert.deepEqual(resumed, ["sess_r"]);
  assert.deepEqual(reopened, []);
  assert.equal(client.generation, 1); // the same session, context intact
  assert.equal(client.resumes, 1);
  assert.equal(client.holding, false);
});

test("resilient: a dead engine's hand-over: the accepted chunk is sent again once, after the resume", async () => {
  const { client, ws } = await resilient();
  const pending = client.appendFrame(JPEG, { binary: false, frameId: "f0" });
  await tick();
  ws.emit({ type: "input.ack", event_id: "e", frame_index: 0, frame_id: "f0", bytes: 10 });
  ws.emit({ type: "response.text.delta", event_id: "e", frame_index: 0, delta: "lost " });
  // The engine died: no response.done for frame 0 here; the store is at the last fold.
  ws.emit({ type: "server.draining", event_id: "e", seconds_left: 0, handover: true });
  ws.emit({ type: "session.closed", event_id: "e", session_id: "sess_r", reason: "server_shutdown", frames_total: 0 });
  ws.serverClose(1000);
  const resent = [];
  client.on("resent", (e) => resent.push(e.frame_index));
  const warn = console.warn;
  console.warn = () => {};
  const resumedAt = (socket) => emitResumed(socket, { rebuilt: true, reprefilled_tokens: 40 });
  try {
    const ws2 = await nextSocket(ws);
    assert.equal(ws2.lastJson().type, "session.resume");
    resumedAt(ws2);
    await tick();
    const again = ws2.lastJson();
    assert.equal(again.type, "frame.append");
    assert.equal(again.frame_id, "f0");
    assert.deepEqual(resent, [0]);
    assert.equal(client.chunksResent, 1);
    ws2.emit({ type: "input.ack", event_id: "e", frame_index: 0, frame_id: "f0", bytes: 10 });
    // Lost once more: not sent a third time (a chunk that kills servers must not kill them all).
    ws2.serverClose(1006);
    const ws3 = await nextSocket(ws2);
    resumedAt(ws3);
    await assert.rejects(pending, (err) => err.code === "connection_lost");
    assert.equal(client.chunksResent, 1);
  } finally {
    console.warn = warn;
  }
});

test("resilient: a refused resume (expired) opens a new session instead", async () => {
  const { client, ws } = await resilient();
  ws.serverClose(1006);
  const ws2 = await nextSocket(ws);
  ws2.emit({ type: "error", event_id: "e", error: { type: "invalid_request_error", code: "session_not_found", message: "no", event_id: null, session_survives: false } });
  ws2.serverClose(1000);
  const ws3 = await nextSocket(ws2);
  assert.equal(ws3.lastJson().type, "session.open");
  ws3.emit({ type: "session.opened", event_id: "e", session_id: "sess_3", config: {}, limits: LIMITS, resume_token: "t3" });
  await tick();
  assert.equal(client.sessionId, "sess_3");
  assert.equal(client.generation, 2);
});

test("resilient: retries are bounded; then the reply in flight fails with connection_lost", async () => {
  const { client, ws } = await resilient({ maxRetries: 3 });
  const pending = client.appendFrame(JPEG);
  await tick();
  let dialled = 0;
  let previous = ws;
  ws.serverClose(1006);
  for (let i = 0; i < 3; i += 1) {
    for (let j = 0; j < 200 && FakeWebSocket.last === previous; j += 1) await new Promise((r) => setTimeout(r, 1));
    previous = FakeWebSocket.last;
    dialled += 1;
    previous.serverClose(1006); // the server is not there
  }
  await assert.rejects(pending, (err) => err.code === "connection_lost");
  assert.equal(dialled, 3);
  assert.equal(client.closed, true);
});

test("ingestFrame sends reply: false and resolves with the ingested response.done (no created, no deltas)", async () => {
  const { client, ws } = await opened();
  const pending = client.ingestFrame(JPEG, { frameId: "w1" });
  await tick();
  const announce = ws.lastJson();
  assert.equal(announce.reply, false);
  assert.equal(announce.binary, true);
  assert.equal("response_format" in announce, false);
  const index = frameIndex++;
  ws.emit({ type: "input.ack", event_id: "e", frame_index: index, frame_id: "w1", bytes: 10 });
  ws.emit({
    type: "response.done",
    event_id: "e",
    frame_index: index,
    frame_id: "w1",
    status: "ingested",
    status_reason: null,
    text: "",
    usage: { prompt_tokens: 20, completion_tokens: 0 },
    timing: { queue_ms: 1, ttft_ms: null, total_ms: 3 },
    retention: null,
  });
  const done = await pending;
  assert.equal(done.status, "ingested");
  assert.equal(client.busy, false);
});

test("ask sends a text chunk with its response_format and streams the answer", async () => {
  const { client, ws } = await opened();
  const seen = [];
  const pending = client.ask("Did anyone enter?", { responseFormat: { type: "json_object" }, onDelta: (d) => seen.push(d) });
  await tick();
  const event = ws.lastJson();
  assert.deepEqual(
    { type: event.type, text: event.text, response_format: event.response_format, reply: event.reply },
    { type: "frame.append", text: "Did anyone enter?", response_format: { type: "json_object" }, reply: undefined },
  );
  reply(ws, { deltas: ['{"a"', ":1}"] });
  const done = await pending;
  assert.deepEqual(JSON.parse(done.text), { a: 1 });
  assert.deepEqual(seen, ['{"a"', ":1}"]);
});

// ------------------------------------------------------------------ async iterators

test("streamFrame: for await yields the deltas; done and text at the end; sent only when iterated", async () => {
  const { client, ws } = await opened();
  const stream = client.streamFrame(JPEG, { prompt: "what?" });
  assert.ok(stream instanceof ResponseStream);
  await tick();
  assert.equal(ws.json().filter((e) => e.type === "frame.append").length, 0, "nothing sent before iteration");
  assert.equal(stream.started, false);
  const seen = [];
  const answering = (async () => {
    for (let i = 0; i < 50 && ws.json().filter((e) => e.type === "frame.append").length === 0; i += 1) await tick();
    reply(ws, { deltas: ["a ", "green ", "cat"] });
  })();
  for await (const delta of stream) {
    assert.equal(delta.type, "response.text.delta");
    seen.push(delta.delta);
    assert.equal(stream.done, null);
  }
  await answering;
  assert.deepEqual(seen, ["a ", "green ", "cat"]);
  assert.equal(stream.text, "a green cat");
  assert.equal(stream.done.type, "response.done");
  assert.equal(stream.done.text, "a green cat");
  assert.equal(ws.json().find((e) => e.type === "frame.append").prompt, "what?");
  assert.equal(client.busy, false);
});

test("ResponseStream: a refused chunk throws from the loop; break leaves the reply running; result() finishes it", async () => {
  const { client, ws } = await opened();
  const first = client.streamText("hello");
  const it = first[Symbol.asyncIterator]();
  const step = it.next();
  await tick();
  // one chunk in flight: a second stream's loop throws the local chunk_in_flight
  await assert.rejects(
    (async () => {
      for await (const _ of client.streamAsk("and?")) assert.fail("nothing to yield");
    })(),
    (err) => err instanceof RealtimeError && err.code === "chunk_in_flight" && err.local,
  );
  const index = frameIndex;
  ws.emit({ type: "input.ack", event_id: "e", frame_index: index, frame_id: null, bytes: 5 });
  ws.emit({ type: "response.text.delta", event_id: "e", frame_index: index, delta: "hi " });
  assert.equal((await step).value.delta, "hi ");
  // leave the loop after the first delta (what `break` calls): the reply goes on
  await it.return();
  frameIndex = index; // reply() continues the same chunk's index (acked above)
  reply(ws, { deltas: ["there"], ack: false });
  const done = await first.result();
  assert.equal(done.text, "there");
  assert.equal(first.done, done);
  assert.equal(first.text, "hi there");
  assert.equal(client.busy, false);
  assert.deepEqual(client.errors, []);
});

test("events(): every server event in order until the session ends; break unsubscribes", async () => {
  const { client, ws } = await opened();
  const all = client.events();
  const types = [];
  const reading = (async () => {
    for await (const event of all) types.push(event.type);
  })();
  const early = [];
  const stopping = (async () => {
    for await (const event of client) {
      early.push(event.type);
      if (event.type === "response.created") break;
    }
  })();
  const pending = client.appendFrame(JPEG);
  await tick();
  reply(ws);
  await pending;
  await stopping;
  const closing = client.close({ timeoutMs: 1000 });
  await tick();
  ws.emit({ type: "session.closed", event_id: "e", reason: "client_closed" });
  ws.serverClose(1000);
  await closing;
  await reading; // ended with the session
  assert.deepEqual(types, ["input.ack", "response.created", "response.text.delta", "response.text.delta", "response.done", "session.closed"]);
  assert.deepEqual(early, ["input.ack", "response.created"]);
  const after = [];
  for await (const event of client.events()) after.push(event);
  assert.deepEqual(after, [], "an ended session's iterator ends at once");
});

test("update() sends only the fields it names and resolves with session.updated", async () => {
  const { client, ws } = await opened();
  const pending = client.update({ sampling: { temperature: 0.7 } });
  await tick();
  const sent = ws.json().filter((e) => e.type === "session.update").pop();
  assert.deepEqual(Object.keys(sent).sort(), ["event_id", "sampling", "type"]);
  assert.deepEqual(sent.sampling, { temperature: 0.7 });
  const config = { ...client.opened.config, sampling: { ...client.opened.config.sampling, temperature: 0.7 } };
  ws.emit({ type: "session.updated", event_id: "e", session_id: client.sessionId, config });
  const updated = await pending;
  assert.equal(updated.config.sampling.temperature, 0.7);
  assert.equal(client.config.sampling.temperature, 0.7);
});

test("a refused update rejects with the server's code and param; the session lives", async () => {
  const { client, ws } = await opened();
  const pending = client.update({ sampling: { max_tokens: 4000 } });
  await tick();
  const { event_id } = ws.json().filter((e) => e.type === "session.update").pop();
  ws.emit({ type: "error", event_id: "e", error: { type: "invalid_request_error", code: "invalid_request", message: "over", event_id, session_survives: true, param: "sampling.max_tokens" } });
  await assert.rejects(pending, (err) => err.code === "invalid_request" && err.param === "sampling.max_tokens");
  assert.equal(client.closed, false);
});

test("update() while a chunk awaits its input.ack: both are answered, in order, by the machine", async () => {
  const { client, ws } = await opened();
  const pending = client.appendText("hello");
  await tick();
  assert.equal(client.machine.state, "awaiting_response");
  const updating = client.update({ frameFormat: "png" });
  await tick();
  assert.deepEqual(client.machine.unanswered.map((s) => s.input), ["frame.append", "session.update"]);
  const index = frameIndex;
  reply(ws, { deltas: ["hi"] }); // its input.ack first: the server answers in the order sent
  ws.emit({ type: "session.updated", event_id: "e", session_id: client.sessionId, config: { ...client.opened.config, frame_format: "png" } });
  assert.equal((await pending).frame_index, index);
  assert.equal((await updating).config.frame_format, "png");
  assert.deepEqual([client.machine.state, client.machine.unanswered, client.machine.nextFrameIndex], ["idle", [], index + 1]);
  assert.deepEqual(client.errors, []);
});

test("resilient: a crashed replica (no drain): the accepted chunk is sent again once after the resume, and said", async () => {
  const { client, ws } = await resilient();
  const pending = client.appendText("what now?", { frameId: "t0" });
  await tick();
  ws.emit({ type: "input.ack", event_id: "e", frame_index: 0, frame_id: "t0", bytes: 9 });
  ws.serverClose(1006); // the replica died with the reply; the store is at the last response.done
  assert.equal(client.machine.state, "parked_awaiting_response"); // its connection's machine
  const resent = [];
  client.on("resent", (e) => resent.push(e));
  const warn = console.warn;
  const warned = [];
  console.warn = (line) => warned.push(line);
  try {
    const ws2 = await nextSocket(ws);
    emitResumed(ws2, { next_frame_index: 0, rebuilt: true }); // "send chunk 0 again"
    await tick();
    const again = ws2.lastJson();
    assert.deepEqual([again.type, again.text, again.frame_id], ["frame.append", "what now?", "t0"]);
    assert.deepEqual(resent, [{ frame_index: 0, frame_id: "t0" }]);
    assert.equal(warned.length, 1);
    assert.match(warned[0], /chunk 0 was lost with its server/);
    assert.equal(client.machine.state, "awaiting_response"); // the new connection's machine
    ws2.emit({ type: "input.ack", event_id: "e", frame_index: 0, frame_id: "t0", bytes: 9 });
    ws2.emit(DONE(0, "answered"));
    assert.equal((await pending).text, "answered");
    assert.equal(client.chunksResent, 1);
    assert.equal(client.machine.state, "idle");
  } finally {
    console.warn = warn;
  }
});

test("resilient: between the drop and the resume the machine is parked; update() says reconnecting", async () => {
  const { client, ws } = await resilient();
  ws.serverClose(1006);
  assert.equal(client.machine.state, "parked");
  const ws2 = await nextSocket(ws);
  assert.equal(ws2.lastJson().type, "session.resume");
  await assert.rejects(client.update({ frameFormat: "png" }), (err) => err.code === "reconnecting" && err.local);
  emitResumed(ws2);
  await tick();
  assert.equal(client.machine.state, "idle");
  assert.deepEqual(client.errors, []);
});
