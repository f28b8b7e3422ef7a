// vllm-realtime JavaScript client: a dependency-free ES module for browsers and Node.
//
//   import { RealtimeClient } from "./realtime-client.js";
//   const client = await RealtimeClient.connect("ws://127.0.0.1:8000/v1/realtime", { apiKey });
//   await client.open({ instructions: "Describe each frame.", retention: { window_chunks: 8 } });
//   const done = await client.appendFrame(jpegBlob, { prompt: "What changed?", onDelta: d => show(d) });
//
// One connection carries one session; one chunk is in flight at a time (docs/protocol.md).
// appendFrame() refuses to send while a reply is pending (a local `chunk_in_flight`, no round
// trip); offerFrame() is the pacing helper for live sources: it sends when idle and drops (and
// counts) the frame otherwise, so nothing queues. streamFrame() / streamText() / streamAsk()
// return a ResponseStream, `for await (const delta of stream)`, and `for await (const event of
// client.events())` reads every server event until the session ends.
//
// The API key: in browsers it travels as the subprotocol `vllm-realtime.auth.<key>` next to
// `vllm-realtime`, because browsers cannot set headers; in Node as `Authorization: Bearer <key>`
// (Node's own WebSocket and the `ws` package both take headers), so the key stays out of the
// subprotocol list. In Node without a global WebSocket (Node 20), pass one:
// `{ WebSocket: (await import("ws")).WebSocket }`.
//
// Resilient sessions: open with `resumable: { grace_s: N }` and the client resumes the session
// after a dropped connection (at most `maxRetries` attempts, backoff from `retryBackoffMs`), and
// after `server.draining` (or a refused resume) it opens a new session with the same settings on
// a new connection once the current reply is done; a `server.draining` with `handover: true` (a
// server with a shared session store) is resumed instead, context intact, on the replica the
// reconnect reaches (behind the router: another one). Meanwhile offerFrame() drops frames and
// appendFrame() rejects with a local `reconnecting`. Events "resumed" and "reopened" tell a UI.

export const PROTOCOL_VERSION = "2026-12-01";
export const SUBPROTOCOL = "vllm-realtime";
export const AUTH_SUBPROTOCOL_PREFIX = "vllm-realtime.auth.";

const WS_OPEN = 1;
const WS_CLOSING = 2;

/** An `error` event from the server, or a failure on the client's side (`local: true`). */
export class RealtimeError extends Error {
  constructor(
    code,
    message,
    { type = "client_error", sessionSurvives = true, eventId = null, local = false, param = null } = {},
  ) {
    super(`${code}: ${message}`);
    this.name = "RealtimeError";
    this.code = code;
    this.type = type;
    this.sessionSurvives = sessionSurvives;
    this.eventId = eventId;
    this.local = local;
    /** The offending field of the client event ("retention.window_chunks"), if the server named one. */
    this.param = param;
  }

  /** The error of a server `error` event's body. */
  static fromDetail(detail) {
    return new RealtimeError(detail.code, detail.message, {
      type: detail.type,
      sessionSurvives: detail.session_survives,
      eventId: detail.event_id ?? null,
      param: detail.param ?? null,
    });
  }
}

/** Node (or a runtime that looks like it), where a WebSocket handshake can carry headers. */
const IN_NODE =
  typeof process === "object" && process !== null && typeof process.versions?.node === "string" && typeof document === "undefined";

/** Node's own WebSocket (undici's, global from Node 22) or a subclass of it. */
function isUndiciWebSocket(WS) {
  const native = IN_NODE ? globalThis.WebSocket : undefined;
  return typeof native === "function" && (WS === native || WS.prototype instanceof native);
}

function localError(code, message, sessionSurvives = true) {
  return new RealtimeError(code, message, { sessionSurvives, local: true });
}

function deferred() {
  let resolve;
  let reject;
  const promise = new Promise((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

// The session's transition tables, the protocol's own (protocol/vllm_realtime_protocol/tables.py):
// `make types` writes them to protocol.tables.json and copies that file here
// (scripts/embed-tables.mjs); tests/clients/test_types_drift.py fails when either drifts.
// BEGIN protocol.tables.json
export const PROTOCOL_TABLES = {
  "transitions": [
    ["connected", "session.open", "idle"],
    ["connected", "session.close", "closed"],
    ["idle", "frame.append", "awaiting_response"],
    ["idle", "frame.append(binary)", "awaiting_binary"],
    ["idle", "session.close", "closed"],
    ["idle", "open_refused", "connected"],
    ["awaiting_binary", "binary", "awaiting_response"],
    ["awaiting_binary", "session.close", "closed"],
    ["awaiting_response", "response.cancel", "awaiting_response"],
    ["awaiting_response", "response_done", "idle"],
    ["awaiting_response", "session.close", "closed"],
    ["closed", "response_done", "closed"],
    ["connected", "engine_error", "closed"],
    ["connected", "disconnect", "closed"],
    ["connected", "idle_timeout", "closed"],
    ["connected", "server_shutdown", "closed"],
    ["connected", "error", "closed"],
    ["idle", "engine_error", "closed"],
    ["idle", "disconnect", "closed"],
    ["idle", "idle_timeout", "closed"],
    ["idle", "server_shutdown", "closed"],
    ["idle", "error", "closed"],
    ["awaiting_binary", "engine_error", "closed"],
    ["awaiting_binary", "disconnect", "closed"],
    ["awaiting_binary", "idle_timeout", "closed"],
    ["awaiting_binary", "server_shutdown", "closed"],
    ["awaiting_binary", "error", "closed"],
    ["awaiting_response", "engine_error", "closed"],
    ["awaiting_response", "disconnect", "closed"],
    ["awaiting_response", "idle_timeout", "closed"],
    ["awaiting_response", "server_shutdown", "closed"],
    ["awaiting_response", "error", "closed"],
    ["closed", "engine_error", "closed"],
    ["closed", "disconnect", "closed"],
    ["closed", "idle_timeout", "closed"],
    ["closed", "server_shutdown", "closed"],
    ["closed", "error", "closed"],
    ["parked", "engine_error", "closed"],
    ["parked", "server_shutdown", "closed"],
    ["parked", "error", "closed"],
    ["parked_awaiting_response", "engine_error", "closed"],
    ["parked_awaiting_response", "server_shutdown", "closed"],
    ["parked_awaiting_response", "error", "closed"],
    ["connected", "session.resume", "connected"],
    ["idle", "detach", "parked"],
    ["awaiting_binary", "detach", "parked"],
    ["awaiting_response", "detach", "parked_awaiting_response"],
    ["parked_awaiting_response", "response_done", "parked"],
    ["parked", "resumed", "idle"],
    ["parked_awaiting_response", "resumed", "awaiting_response"],
    ["parked", "expire", "closed"],
    ["parked_awaiting_response", "expire", "closed"],
    ["closed", "expire", "closed"],
    ["idle", "session.update", "idle"],
    ["awaiting_binary", "session.update", "awaiting_binary"],
    ["awaiting_response", "session.update", "awaiting_response"]
  ],
  "refusals": [
    ["connected", "frame.append", "session_not_open"],
    ["connected", "frame.append(binary)", "session_not_open"],
    ["connected", "binary", "binary_unexpected"],
    ["connected", "response.cancel", "session_not_open"],
    ["connected", "open_refused", "internal_error"],
    ["connected", "response_done", "internal_error"],
    ["idle", "session.open", "session_already_open"],
    ["idle", "binary", "binary_unexpected"],
    ["idle", "response.cancel", "no_response_in_flight"],
    ["idle", "response_done", "internal_error"],
    ["awaiting_binary", "session.open", "session_already_open"],
    ["awaiting_binary", "frame.append", "chunk_in_flight"],
    ["awaiting_binary", "frame.append(binary)", "chunk_in_flight"],
    ["awaiting_binary", "response.cancel", "no_response_in_flight"],
    ["awaiting_binary", "open_refused", "internal_error"],
    ["awaiting_binary", "response_done", "internal_error"],
    ["awaiting_response", "session.open", "session_already_open"],
    ["awaiting_response", "frame.append", "chunk_in_flight"],
    ["awaiting_response", "frame.append(binary)", "chunk_in_flight"],
    ["awaiting_response", "binary", "binary_unexpected"],
    ["awaiting_response", "open_refused", "internal_error"],
    ["closed", "session.open", "session_closed"],
    ["closed", "frame.append", "session_closed"],
    ["closed", "frame.append(binary)", "session_closed"],
    ["closed", "binary", "session_closed"],
    ["closed", "response.cancel", "session_closed"],
    ["closed", "session.close", "session_closed"],
    ["closed", "open_refused", "internal_error"],
    ["idle", "session.resume", "session_already_open"],
    ["awaiting_binary", "session.resume", "session_already_open"],
    ["awaiting_response", "session.resume", "session_already_open"],
    ["closed", "session.resume", "session_closed"],
    ["connected", "session.update", "session_not_open"],
    ["closed", "session.update", "session_closed"],
    ["connected", "detach", "internal_error"],
    ["connected", "resumed", "internal_error"],
    ["connected", "expire", "internal_error"],
    ["closed", "detach", "internal_error"],
    ["closed", "resumed", "internal_error"],
    ["idle", "resumed", "internal_error"],
    ["idle", "expire", "internal_error"],
    ["awaiting_binary", "resumed", "internal_error"],
    ["awaiting_binary", "expire", "internal_error"],
    ["awaiting_response", "resumed", "internal_error"],
    ["awaiting_response", "expire", "internal_error"],
    ["parked", "response_done", "internal_error"],
    ["parked", "session.open", "internal_error"],
    ["parked", "frame.append", "internal_error"],
    ["parked", "frame.append(binary)", "internal_error"],
    ["parked", "binary", "internal_error"],
    ["parked", "response.cancel", "internal_error"],
    ["parked", "session.close", "internal_error"],
    ["parked", "session.resume", "internal_error"],
    ["parked", "session.update", "internal_error"],
    ["parked", "open_refused", "internal_error"],
    ["parked", "disconnect", "internal_error"],
    ["parked", "idle_timeout", "internal_error"],
    ["parked", "detach", "internal_error"],
    ["parked_awaiting_response", "session.open", "internal_error"],
    ["parked_awaiting_response", "frame.append", "internal_error"],
    ["parked_awaiting_response", "frame.append(binary)", "internal_error"],
    ["parked_awaiting_response", "binary", "internal_error"],
    ["parked_awaiting_response", "response.cancel", "internal_error"],
    ["parked_awaiting_response", "session.close", "internal_error"],
    ["parked_awaiting_response", "session.resume", "internal_error"],
    ["parked_awaiting_response", "session.update", "internal_error"],
    ["parked_awaiting_response", "open_refused", "internal_error"],
    ["parked_awaiting_response", "disconnect", "internal_error"],
    ["parked_awaiting_response", "idle_timeout", "internal_error"],
    ["parked_awaiting_response", "detach", "internal_error"]
  ],
  "client_inputs": [
    ["session.open"],
    ["frame.append"],
    ["frame.append(binary)"],
    ["binary"],
    ["response.cancel"],
    ["session.close"],
    ["session.resume"],
    ["session.update"]
  ],
  "refused_payload_state": [
    ["binary", "idle"]
  ]
};
// END protocol.tables.json

const LIVE_STATES = ["idle", "awaiting_binary", "awaiting_response"];
const REFUSAL_HINTS = {
  chunk_in_flight: "a chunk is already in flight; wait for its response.done",
  session_not_open: "call open() first",
  session_already_open: "open() was already called",
  session_closed: "the session is closed",
  no_response_in_flight: "no reply is in flight",
  binary_unexpected: "no frame.append announced a binary payload",
};

/**
 * The session's state as the client sees it, stepped through the protocol's tables: the JS
 * form of the Python ClientProtocol (protocol/vllm_realtime_protocol/client.py), with the same rules.
 * `send(event)` throws the server's own refusal (a local RealtimeError with the server's code)
 * where the tables refuse, else moves the state; `receive(event)` confirms, undoes the send a
 * surviving error refuses (the one whose event_id it echoes), or applies the server's
 * happenings (response.done, session.closed, a fatal error); `connectionLost()` parks a
 * resumable session or ends it. It does no I/O.
 */
export class ClientMachine {
  constructor(tables = PROTOCOL_TABLES) {
    const key = (state, input) => `${state} ${input}`;
    this._key = key;
    this._next = new Map(tables.transitions.map(([state, input, next]) => [key(state, input), next]));
    this._refused = new Map(tables.refusals.map(([state, input, code]) => [key(state, input), code]));
    this._payloadState = new Map(tables.refused_payload_state);
    this.state = "connected";
    /** Sent inputs awaiting their answers, oldest first: { input, before, eventId }. */
    this.unanswered = [];
    this.sessionId = null;
    this.limits = null;
    this.config = null;
    this.nextFrameIndex = 0;
    this.inFlightFrameIndex = null;
    this.resumeToken = null;
    this.closeReason = null;
  }

  /** The tables' input a client event is. */
  static inputOf(event) {
    if (event.type === "frame.append") return event.binary ? "frame.append(binary)" : "frame.append";
    return event.type;
  }

  /** A chunk is in flight: sent (or announced), its response.done not received. */
  get busy() {
    return this.state === "awaiting_binary" || this.state === "awaiting_response" || this.state === "parked_awaiting_response";
  }

  /** Throw the server's refusal of `event` in this state (nothing changes either way). */
  check(event) {
    this._refuse(ClientMachine.inputOf(event));
  }

  /** Check `event` against the tables and step; returns it, to be sent. */
  send(event) {
    this._step(ClientMachine.inputOf(event), event.event_id ?? null);
    return event;
  }

  /** Check and step a binary message (the payload of a `binary: true` frame.append). */
  sendBinary(data) {
    this._step("binary", null);
    return data;
  }

  _refuse(input) {
    const code = this._refused.get(this._key(this.state, input));
    if (code !== undefined) throw localError(code, `${REFUSAL_HINTS[code] ?? "refused"} (${input} in state ${this.state})`);
  }

  _step(input, eventId) {
    this._refuse(input);
    const last = this.unanswered[this.unanswered.length - 1];
    if (input === "binary" && last && last.input === "frame.append(binary)") {
      this.unanswered[this.unanswered.length - 1] = { input, before: this.state, eventId: last.eventId };
    } else if (input !== "response.cancel") {
      this.unanswered.push({ input, before: this.state, eventId });
    }
    this.state = this._next.get(this._key(this.state, input));
  }

  /** The connection is gone: a resumable open session is parked (detach), any other ends. */
  connectionLost() {
    this.unanswered = [];
    const resumable = this.config !== null && this.config.resumable != null;
    const input = resumable && LIVE_STATES.includes(this.state) ? "detach" : "disconnect";
    this.state = this._next.get(this._key(this.state, input)) ?? this.state;
  }

  /** Apply a server event (events that change nothing are accepted too). */
  receive(event) {
    switch (event.type) {
      case "session.created":
        this.sessionId = event.session_id;
        this.limits = event.limits;
        break;
      case "session.opened":
        this._answered(["session.open"]);
        this.sessionId = event.session_id;
        this.limits = event.limits;
        this.config = event.config;
        this.resumeToken = event.resume_token ?? null;
        break;
      case "session.updated":
        this._answered(["session.update"]);
        this.config = event.config;
        break;
      case "input.ack":
        if (this._answered(["frame.append", "binary"]) === null) {
          throw localError("internal_error", `input.ack with no chunk sent (state ${this.state})`, false);
        }
        this.inFlightFrameIndex = event.frame_index;
        this.nextFrameIndex = event.frame_index + 1;
        break;
      case "response.done":
        this._serverInput("response_done");
        this.inFlightFrameIndex = null;
        break;
      case "session.resumed":
        this._answered(["session.resume"]);
        this.state = this._next.get(this._key(event.in_flight_frame_index == null ? "parked" : "parked_awaiting_response", "resumed"));
        this.sessionId = event.session_id;
        this.limits = event.limits;
        this.config = event.config;
        this.nextFrameIndex = event.next_frame_index;
        this.inFlightFrameIndex = event.in_flight_frame_index ?? null;
        this.resumeToken = event.resume_token;
        break;
      case "session.closed":
        this.unanswered = [];
        this.state = "closed";
        this.closeReason = event.reason;
        break;
      case "error":
        this._error(event.error || {});
        break;
      default:
        break;
    }
  }

  _answered(inputs) {
    const at = this.unanswered.findIndex((sent) => inputs.includes(sent.input));
    return at < 0 ? null : this.unanswered.splice(at, 1)[0];
  }

  _serverInput(input) {
    const next = this._next.get(this._key(this.state, input));
    if (next === undefined) throw localError("internal_error", `server sent ${input} in state ${this.state}`, false);
    this.state = next;
  }

  _error(detail) {
    if (!detail.session_survives) {
      this.unanswered = [];
      this._serverInput("error");
      return;
    }
    const pending = this.unanswered;
    const eventId = detail.event_id ?? null;
    let at;
    if (eventId !== null) {
      at = pending.findIndex((sent) => sent.eventId === eventId);
    } else {
      // An error with no event_id answers a send that had none (the server echoes every
      // event_id; a binary message refused for want of an announcement has none): the oldest,
      // passing over an announcement that later sends followed (the server answers an
      // accepted announcement only with its payload's input.ack).
      const unnamed = pending.map((sent, n) => n).filter((n) => pending[n].eventId === null);
      at = unnamed.find((n, k) => pending[n].input !== "frame.append(binary)" || k === unnamed.length - 1) ?? -1;
    }
    if (at < 0) return; // it answers no send awaiting its answer (e.g. a late cancel's)
    const refused = pending[at];
    if ((this._next.get(this._key(refused.before, refused.input)) ?? refused.before) === refused.before) {
      // It moved nothing (session.update, session.resume), so nothing is undone: the state may
      // have moved since by the server's own events (a response.done).
      this.unanswered = [...pending.slice(0, at), ...pending.slice(at + 1)];
      return;
    }
    let state = this._payloadState.get(refused.input) ?? refused.before;
    const later = pending.slice(at + 1).map((sent) => {
      const replayed = { ...sent, before: state };
      state = this._next.get(this._key(state, sent.input)) ?? state;
      return replayed;
    });
    this.unanswered = [...pending.slice(0, at), ...later];
    this.state = state;
  }
}

function toBase64(bytes) {
  let binary = "";
  const step = 0x8000;
  for (let i = 0; i < bytes.length; i += step) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + step));
  }
  return btoa(binary);
}

/** Name the container of `bytes` from its magic bytes (as the server does), or null. */
export function sniffMedia(bytes) {
  const b = bytes;
  if (b.length >= 3 && b[0] === 0xff && b[1] === 0xd8 && b[2] === 0xff) return "jpeg";
  if (b.length >= 8 && b[0] === 0x89 && b[1] === 0x50 && b[2] === 0x4e && b[3] === 0x47) return "png";
  const ascii = (from, to) => String.fromCharCode(...b.subarray(from, to));
  if (b.length >= 12 && ascii(0, 4) === "RIFF" && ascii(8, 12) === "WEBP") return "webp";
  if (b.length >= 8 && ascii(4, 8) === "ftyp") return "mp4";
  if (b.length >= 4 && b[0] === 0x1a && b[1] === 0x45 && b[2] === 0xdf && b[3] === 0xa3) return "webm";
  return null;
}

async function toBytes(data) {
  if (data instanceof Uint8Array) return data;
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  if (data && typeof data.arrayBuffer === "function") return new Uint8Array(await data.arrayBuffer()); // Blob
  throw new TypeError("frame data must be a Blob, an ArrayBuffer, a typed array or a base64 string");
}

/**
 * One connection to `/v1/realtime` and its one session.
 * Use `await RealtimeClient.connect(url, options)`; the constructor starts the handshake and
 * `client.ready` settles on `session.created`.
 */
export class RealtimeClient {
  static async connect(url, options = {}) {
    const client = new RealtimeClient(url, options);
    await client.ready;
    return client;
  }

  constructor(url, options = {}) {
    const {
      apiKey = null,
      WebSocket: WS = globalThis.WebSocket,
      timeoutMs = 60000,
      openTimeoutMs = 10000,
      onEvent = null,
      maxRetries = 8,
      retryBackoffMs = 500,
      apiKeyIn = IN_NODE ? "header" : "subprotocol",
    } = options;
    if (apiKeyIn !== "header" && apiKeyIn !== "subprotocol") {
      throw new TypeError(`apiKeyIn must be "header" or "subprotocol", not ${JSON.stringify(apiKeyIn)}`);
    }
    if (typeof WS !== "function") {
      throw new TypeError("no WebSocket implementation: pass { WebSocket } (e.g. from the 'ws' package)");
    }
    this.url = url;
    this.timeoutMs = timeoutMs;
    this.openTimeoutMs = openTimeoutMs;
    this.maxRetries = maxRetries;
    this.retryBackoffMs = retryBackoffMs;
    this._WS = WS;
    this._apiKey = apiKey;
    this.apiKeyIn = apiKeyIn;
    this.generation = 1; // +1 for every new session opened after a drain or a refused resume
    this.resumes = 0; // successful session.resume
    this.chunksResent = 0; // chunks sent again because their reply was lost with its server
    this.draining = null; // the last server.draining
    this._resumeToken = null;
    this._machine = new ClientMachine(); // the session's turn state: the protocol's tables
    this._recovering = false;
    this._moving = false; // session.closed(server_shutdown) of a resilient session arrived
    this._userClosing = false;
    this._handshake = null; // the one-off waiter of a reconnection
    this.created = null; // session.created
    this.opened = null; // session.opened
    this.closedEvent = null; // session.closed
    this.fatal = null; // the error that ended the session
    this.errors = []; // surviving errors that answered no pending call (newest last, at most 64)
    this.stats = { framesSent: 0, replies: 0, dropped: 0, errors: 0 };
    this._listeners = new Map();
    if (onEvent) this.on("event", onEvent);
    this._ids = 0;
    this._turn = null;
    this._starting = false; // a frame is being prepared (Blob read) for sending
    this._openWait = null;
    this._updateWaits = new Map(); // event_id -> deferred, answered in order by session.updated
    this._closeWait = deferred();
    this._cancelIds = new Set();
    this._ended = false;
    this._ready = deferred();
    this.ready = this._ready.promise;
    this.ready.catch(() => {}); // a caller that never awaits `ready` must not see an unhandled rejection

    this._ws = this._dial();
    const openTimer = setTimeout(() => {
      this._ready.reject(localError("connection_failed", `no session.created within ${openTimeoutMs} ms`, false));
      this._closeSocket();
    }, openTimeoutMs);
    this.ready.then(() => clearTimeout(openTimer), () => clearTimeout(openTimer));
  }

  /** A new socket whose events reach this client only while it is the current one. */
  _dial() {
    const protocols = [SUBPROTOCOL];
    let ws;
    if (this._apiKey && this.apiKeyIn === "header") {
      // Node's own WebSocket takes a WebSocketInit ({ protocols, headers }) as its second
      // argument; the `ws` package takes (url, protocols, { headers }).
      const headers = { Authorization: `Bearer ${this._apiKey}` };
      ws = isUndiciWebSocket(this._WS) ? new this._WS(this.url, { protocols, headers }) : new this._WS(this.url, protocols, { headers });
    } else {
      if (this._apiKey) protocols.push(AUTH_SUBPROTOCOL_PREFIX + this._apiKey);
      ws = new this._WS(this.url, protocols);
    }
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      if (ws === this._ws && ws.protocol && ws.protocol !== SUBPROTOCOL) {
        this._ready.reject(localError("connection_failed", `server selected subprotocol '${ws.protocol}'`, false));
        this._closeSocket();
      }
    };
    ws.onmessage = (message) => {
      if (ws === this._ws) this._onMessage(message.data);
    };
    ws.onerror = () => {}; // a close event always follows; it carries what we can know
    ws.onclose = (event) => {
      if (ws === this._ws) this._onClose(event);
    };
    return ws;
  }

  /** The session's id (from session.opened or session.resumed, else session.created). */
  get sessionId() {
    if (this.opened) return this.opened.session_id;
    return this.created ? this.created.session_id : null;
  }

  /** Whether the session resumes after a drop and moves on after a drain. */
  get resilient() {
    return this._resumeToken !== null && this.maxRetries > 0;
  }

  /** True while the client reconnects, or the server drains (no new chunk goes out). */
  get holding() {
    return this._recovering || (this.draining !== null && this.resilient);
  }

  /** What the server allows (from session.opened, else session.created). */
  get limits() {
    return (this.opened || this.created || {}).limits || null;
  }

  /** The effective session settings, once open. */
  get config() {
    return this.opened ? this.opened.config : null;
  }

  /** True while a chunk is in flight (sent, its response.done not received yet). */
  get busy() {
    return this._starting || this.holding || this._machine.busy || (this._turn !== null && !this._turn.finished);
  }

  /** The session's protocol machine (state, next frame index, unanswered sends), stepped by the protocol's tables. */
  get machine() {
    return this._machine;
  }

  /** True once the session has ended (either side closed, or the socket went away). */
  get closed() {
    return this._ended || this.fatal !== null || this.closedEvent !== null;
  }

  /**
   * Subscribe to server events: `"event"` (every event), an event type such as
   * `"response.text.delta"`, or `"close"` (the socket closed). Returns an unsubscribe function.
   */
  on(type, listener) {
    if (!this._listeners.has(type)) this._listeners.set(type, new Set());
    this._listeners.get(type).add(listener);
    return () => this._listeners.get(type).delete(listener);
  }

  /** Send session.open; resolves with session.opened, rejects with the server's error. */
  async open(config = {}) {
    this._checkAlive();
    if (this._openWait) throw localError("session_already_open", "open() was already called");
    const eventId = this._newId();
    const event = { type: "session.open", event_id: eventId, ...config };
    this._machine.check(event); // session_already_open
    const wait = deferred();
    this._openWait = { eventId, ...wait };
    try {
      this._send(event);
      this.opened = await this._withTimeout(wait.promise, this.timeoutMs, "session.opened");
      this._resumeToken = this.opened.resume_token ?? null;
      return this.opened;
    } finally {
      this._openWait = null;
    }
  }

  /**
   * Send session.update; resolves with session.updated. Later chunks use the new settings (a
   * reply in flight keeps its own): `sampling` changes only the fields it names, e.g.
   * `update({ sampling: { temperature: 0.7 } })`; `frameFormat` replaces the frame format.
   * Instructions, retention, modality and limits are fixed: the server refuses them with
   * `invalid_request`, `err.param` naming the field.
   */
  async update({ sampling = null, frameFormat = null } = {}) {
    this._checkAlive();
    if (!this.opened) throw localError("session_not_open", "call open() before update()");
    const eventId = this._newId();
    const event = { type: "session.update", event_id: eventId };
    if (sampling !== null) event.sampling = sampling;
    if (frameFormat !== null) event.frame_format = frameFormat;
    const wait = deferred();
    this._updateWaits.set(eventId, wait);
    try {
      this._send(event);
      const updated = await this._withTimeout(wait.promise, this.timeoutMs, "session.updated");
      this.opened = { ...this.opened, config: updated.config };
      return updated;
    } finally {
      this._updateWaits.delete(eventId);
    }
  }

  /**
   * Send one image (JPEG/PNG/WebP) or clip (MP4/WebM) and resolve with its response.done.
   * `data`: a Blob, ArrayBuffer, typed array (binary message) or a base64 / data-URL string.
   * Options: prompt, frameId, timestamp, binary (default true), timeoutMs, onDelta(delta, textSoFar).
   * Rejects at once with a local `chunk_in_flight` if a reply is pending.
   */
  async appendFrame(data, options = {}) {
    this._checkReady();
    this._starting = true;
    let prepared;
    try {
      prepared = await this._prepareFrame(data, options);
    } finally {
      this._starting = false;
    }
    return this._startTurn(prepared.fields, prepared.bytes, options);
  }

  /** Send one text turn and resolve with its response.done (in a `"video"` session: a question). */
  async appendText(text, options = {}) {
    this._checkReady();
    return this._startTurn({ ...this._frameFields(options), text }, null, options);
  }

  /**
   * Watch one frame without a reply (`frame.append` with `reply: false`): it is prefilled into
   * the context and resolves with a response.done of status "ingested" (empty text, no
   * response.created, no deltas). Options as appendFrame (no responseFormat).
   */
  async ingestFrame(data, options = {}) {
    return this.appendFrame(data, { ...options, reply: false, responseFormat: null });
  }

  /**
   * Ask a question between frames (a text chunk, also in "video" sessions) and resolve with its
   * response.done; stream the answer with `onDelta`. `responseFormat` (OpenAI's shape, e.g.
   * `{type: "json_object"}`) constrains this answer, overriding the session's.
   */
  async ask(question, options = {}) {
    return this.appendText(question, { ...options, reply: true });
  }

  /**
   * Pacing for live sources: if no chunk is in flight, send the frame (`dataOrFactory` may be a
   * function, called only then, returning the data or a promise of it) and resolve with its
   * response.done; otherwise count it in `stats.dropped` and resolve with null. Never queues.
   */
  async offerFrame(dataOrFactory, options = {}) {
    if (this.busy) {
      this.stats.dropped += 1;
      return null;
    }
    this._checkReady();
    this._starting = true;
    let prepared;
    try {
      const data = typeof dataOrFactory === "function" ? await dataOrFactory() : dataOrFactory;
      prepared = await this._prepareFrame(data, options);
    } finally {
      this._starting = false;
    }
    return this._startTurn(prepared.fields, prepared.bytes, options);
  }

  /**
   * Send one frame and stream its reply: `for await (const delta of client.streamFrame(jpeg))`
   * yields each response.text.delta event; `stream.done` is then the response.done and
   * `stream.text` the reply. The frame is sent when iteration starts (or at `stream.result()`).
   * Options as appendFrame.
   */
  streamFrame(data, options = {}) {
    return new ResponseStream((onDelta) => this.appendFrame(data, { ...options, onDelta }), options.onDelta);
  }

  /** As appendText, streamed: a ResponseStream of the text turn's reply. */
  streamText(text, options = {}) {
    return new ResponseStream((onDelta) => this.appendText(text, { ...options, onDelta }), options.onDelta);
  }

  /** As ask, streamed: a ResponseStream of the answer to a question between frames. */
  streamAsk(question, options = {}) {
    return new ResponseStream((onDelta) => this.ask(question, { ...options, onDelta }), options.onDelta);
  }

  /**
   * Every server event from now on, in order, until the session ends (the socket closed for
   * good; a resilient session's reconnections do not end it): `for await (const event of
   * client.events())`. Each iterator gets every event; `break` unsubscribes.
   */
  events() {
    const queue = [];
    let ended = this._ended;
    let wake = null;
    const notify = () => {
      if (wake) wake();
      wake = null;
    };
    const offEvent = this.on("event", (event) => {
      queue.push(event);
      notify();
    });
    const offClose = this.on("close", () => {
      ended = true;
      notify();
    });
    const stop = () => {
      offEvent();
      offClose();
      ended = true;
      queue.length = 0;
    };
    return {
      [Symbol.asyncIterator]() {
        return this;
      },
      async next() {
        while (queue.length === 0 && !ended) await new Promise((resolve) => (wake = resolve));
        if (queue.length > 0) return { value: queue.shift(), done: false };
        stop();
        return { value: undefined, done: true };
      },
      async return() {
        stop();
        notify();
        return { value: undefined, done: true };
      },
    };
  }

  /** `for await (const event of client)`: as client.events(). */
  [Symbol.asyncIterator]() {
    return this.events();
  }

  /** Cancel the reply in flight; resolves with its response.done (null if nothing was in flight). */
  async cancel() {
    const turn = this._turn;
    if (!turn || turn.finished) return null;
    this._sendCancel(turn);
    return turn.promise;
  }

  /**
   * End the session: send session.close, wait for session.closed (at most `timeoutMs`), close
   * the socket. A reply in flight is cancelled by the server. Safe to call twice.
   */
  async close({ timeoutMs = 5000 } = {}) {
    this._userClosing = true;
    if (this._recovering) {
      this._closeSocket();
      this._end(localError("connection_lost", "the client closed while reconnecting", false));
      return this.closedEvent;
    }
    if (!this._ended && this.fatal === null && this.closedEvent === null && this._ws.readyState === WS_OPEN) {
      try {
        this._send({ type: "session.close", event_id: this._newId() });
      } catch {
        // the socket went away meanwhile
      }
    }
    if (!this._ended) {
      let timer;
      const timeout = new Promise((resolve) => {
        timer = setTimeout(resolve, timeoutMs);
      });
      await Promise.race([this._closeWait.promise, timeout]);
      clearTimeout(timer);
      this._closeSocket();
    }
    return this.closedEvent;
  }

  // ------------------------------------------------------------------ internals

  _newId() {
    this._ids += 1;
    return `js-${this._ids}`;
  }

  _emit(type, payload) {
    for (const key of [type, "event"]) {
      if (key === "event" && type === "close") continue;
      const set = this._listeners.get(key);
      if (!set) continue;
      for (const fn of [...set]) {
        try {
          fn(payload);
        } catch (err) {
          console.error("vllm-realtime listener failed", err);
        }
      }
    }
  }

  _checkAlive() {
    if (this.fatal) throw this.fatal;
    if (this.closedEvent) throw localError("session_closed", `the session is closed (${this.closedEvent.reason})`, false);
    if (this._ended || this._ws.readyState >= WS_CLOSING) throw localError("connection_lost", "the connection is closed", false);
  }

  _checkReady() {
    this._checkAlive();
    if (!this.opened) throw localError("session_not_open", "call open() before sending chunks");
    if (this.holding) throw localError("reconnecting", "the session is moving to a new connection; try again shortly");
    if (this._starting) throw localError("chunk_in_flight", REFUSAL_HINTS.chunk_in_flight);
    this._machine.check({ type: "frame.append" }); // chunk_in_flight, session_closed
  }

  _frameFields({ prompt = null, frameId = null, timestamp = null, reply = true, responseFormat = null }) {
    const fields = { type: "frame.append" };
    if (reply === false) fields.reply = false;
    if (responseFormat !== null && responseFormat !== undefined) fields.response_format = responseFormat;
    if (prompt !== null && prompt !== undefined) fields.prompt = prompt;
    if (frameId !== null && frameId !== undefined) fields.frame_id = frameId;
    if (timestamp !== null && timestamp !== undefined) fields.timestamp = timestamp;
    return fields;
  }

  async _prepareFrame(data, options) {
    const { binary = true } = options;
    const fields = this._frameFields(options);
    if (typeof data === "string") return { fields: { ...fields, image: data }, bytes: null };
    const bytes = await toBytes(data);
    const media = sniffMedia(bytes);
    if (media === null) throw localError("undecodable_frame", "payload is not JPEG, PNG, WebP, MP4 or WebM");
    const limit = this.limits && this.limits.max_frame_bytes;
    if (limit && bytes.length > limit) {
      throw localError("frame_too_large", `payload is ${bytes.length} bytes; the server's limit is ${limit}`);
    }
    if (binary) return { fields: { ...fields, binary: true }, bytes };
    const field = media === "mp4" || media === "webm" ? "video" : "image";
    return { fields: { ...fields, [field]: toBase64(bytes) }, bytes: null };
  }

  /** Send an event (and its binary payload), each stepped through the machine first. */
  _send(event, binaryPayload = null) {
    this._checkAlive();
    if (this._machine.state === "parked" || this._machine.state === "parked_awaiting_response") {
      // The server holds the session for a resume, which takes a new connection.
      throw localError("reconnecting", "the connection is gone; the session is being resumed");
    }
    this._ws.send(JSON.stringify(this._machine.send(event)));
    if (binaryPayload !== null) this._ws.send(this._machine.sendBinary(binaryPayload));
  }

  _startTurn(fields, binaryPayload, options) {
    if (this._turn !== null && !this._turn.finished) throw localError("chunk_in_flight", REFUSAL_HINTS.chunk_in_flight);
    this._machine.check(fields); // the server's own refusals, from the tables
    const eventId = this._newId();
    const wait = deferred();
    const turn = {
      eventId,
      fields: { ...fields, event_id: eventId }, // to send again if the server never accepted it
      binaryPayload,
      frameId: fields.frame_id ?? null,
      ack: null,
      created: null,
      done: null,
      text: "",
      finished: false,
      onDelta: options.onDelta || null,
      promise: wait.promise,
      resolve: wait.resolve,
      reject: wait.reject,
      timer: null,
    };
    wait.promise.catch(() => {}); // cancel() and timeouts may leave nobody awaiting it
    this._turn = turn;
    const timeoutMs = options.timeoutMs ?? this.timeoutMs;
    if (timeoutMs) {
      turn.timer = setTimeout(() => {
        // Stop the work; the turn stays in flight (busy) until its response.done arrives.
        this._sendCancel(turn);
        const err = localError("timeout", `no response.done within ${timeoutMs} ms; the reply was cancelled`);
        turn.reject(err);
      }, timeoutMs);
    }
    try {
      this._send(turn.fields, binaryPayload);
    } catch (err) {
      if (!this.resilient) {
        this._finishTurn(turn, null, err);
        throw err;
      }
      // The socket is going away: the client reconnects and sends the chunk again.
    }
    this.stats.framesSent += 1;
    return turn.promise;
  }

  _finishTurn(turn, done, err = null) {
    if (turn.finished) return;
    turn.finished = true;
    if (turn.timer) clearTimeout(turn.timer);
    if (done) {
      turn.done = done;
      this.stats.replies += 1;
      turn.resolve(done);
    } else {
      turn.reject(err);
    }
  }

  _sendCancel(turn) {
    if (turn.finished) return;
    const eventId = this._newId();
    this._cancelIds.add(eventId);
    try {
      this._send({ type: "response.cancel", event_id: eventId });
    } catch {
      // the socket went away: the turn is failed by the close handler
    }
  }

  _withTimeout(promise, ms, what) {
    if (!ms) return promise;
    let timer;
    const timeout = new Promise((_, reject) => {
      timer = setTimeout(() => reject(localError("timeout", `no ${what} within ${ms} ms`)), ms);
    });
    return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
  }

  _closeSocket() {
    try {
      if (this._ws.readyState < WS_CLOSING) this._ws.close(1000);
    } catch {
      // already closing
    }
  }

  _failPending(err, includeAcked) {
    if (this._openWait) this._openWait.reject(err);
    const turn = this._turn;
    if (turn && !turn.finished && (includeAcked || turn.ack === null)) this._finishTurn(turn, null, err);
  }

  _onMessage(data) {
    let event;
    try {
      const text = typeof data === "string" ? data : new TextDecoder().decode(data);
      event = JSON.parse(text);
    } catch {
      return; // not for us
    }
    if (!event || typeof event.type !== "string") return;
    if (this._handshake) {
      this._handshake(event); // a reconnection's greeting and answer
      this._emit(event.type, event);
      return;
    }
    this._step(this._machine, event);
    const turn = this._turn;
    const matches = (index) => turn && turn.ack && turn.ack.frame_index === index;
    switch (event.type) {
      case "session.created":
        this.created = event;
        this._ready.resolve(this);
        break;
      case "session.updated":
        for (const wait of this._updateWaits.values()) {
          if (!wait.settled) {
            wait.settled = true;
            wait.resolve(event);
            break;
          }
        }
        break;
      case "session.opened":
        if (this._openWait) this._openWait.resolve(event);
        break;
      case "input.ack":
        if (turn && !turn.finished && turn.ack === null) turn.ack = event;
        break;
      case "response.created":
        if (matches(event.frame_index)) turn.created = event;
        break;
      case "response.text.delta":
        if (matches(event.frame_index)) {
          turn.text += event.delta;
          if (turn.onDelta) {
            try {
              turn.onDelta(event.delta, turn.text, event);
            } catch (err) {
              console.error("vllm-realtime onDelta failed", err);
            }
          }
        }
        break;
      case "response.done":
        if (matches(event.frame_index)) this._finishTurn(turn, event);
        break;
      case "server.draining":
        this.draining = event; // resilient: hold new chunks; the session moves after this reply
        break;
      case "session.closed":
        if (this.resilient && event.reason === "server_shutdown" && !this._userClosing) {
          this._moving = true; // a new session follows on a new connection
          break;
        }
        this.closedEvent = event;
        this._failPending(this.fatal || localError("session_closed", `the session was closed (${event.reason})`, false), true);
        break;
      case "error":
        this._onError(event);
        break;
      default:
        break; // a newer server's event: ignore
    }
    this._emit(event.type, event);
  }

  /** Feed a server event to `machine`; one out of the protocol's order is the server's bug, kept in `errors`. */
  _step(machine, event) {
    try {
      machine.receive(event);
    } catch (err) {
      console.error(`vllm-realtime: server event out of order: ${err.message}`);
      this._keep(err);
    }
  }

  _keep(err) {
    this.errors.push(err);
    if (this.errors.length > 64) this.errors.shift();
  }

  _onError(event) {
    const detail = event.error || {};
    const err = RealtimeError.fromDetail(detail);
    this.stats.errors += 1;
    if (!this.created) {
      this._ready.reject(err);
      return;
    }
    if (!detail.session_survives) {
      this.fatal = err; // session.closed follows; an accepted chunk still gets its response.done
      this._failPending(err, false);
      return;
    }
    if (this._openWait && detail.event_id === this._openWait.eventId) {
      this._openWait.reject(err);
      return;
    }
    const updating = this._updateWaits.get(detail.event_id);
    if (updating && !updating.settled) {
      updating.settled = true;
      updating.reject(err);
      return;
    }
    const turn = this._turn;
    if (turn && !turn.finished && turn.ack === null && detail.event_id === turn.eventId) {
      this._finishTurn(turn, null, err);
      return;
    }
    if (this._cancelIds.delete(detail.event_id) && detail.code === "no_response_in_flight") return;
    this._keep(err);
  }

  _onClose(event) {
    // The server parks a resumable session (a resume takes it over, with a new machine) and ends any other.
    this._machine.connectionLost();
    const recoverable = this.resilient && !this._userClosing && this.fatal === null && (this.closedEvent === null || this._moving);
    if (recoverable && this.created && this.opened) {
      // Drained: a new session, unless the server handed the session over (a session store
      // keeps it): then it is resumed, on whichever replica the reconnect reaches.
      const handover = this.draining !== null && this.draining.handover === true;
      this._recover(this._moving && !handover);
      return;
    }
    this._end(null, event);
  }

  _end(error, event = null) {
    const wasEnded = this._ended;
    this._ended = true;
    const why = error ? error.message : `the connection closed (code ${event && event.code})`;
    if (!this.created) {
      const hint = " before session.created; a missing or wrong API key is refused in the handshake";
      this._ready.reject(localError("connection_failed", why + hint, false));
    }
    const err =
      this.fatal ||
      (this.closedEvent ? localError("session_closed", `the session was closed (${this.closedEvent.reason})`, false) : error || localError("connection_lost", why, false));
    this._failPending(err, true);
    this._closeWait.resolve();
    if (!wasEnded) this._emit("close", { code: event && event.code, reason: event && event.reason });
  }

  // ------------------------------------------------------------------ resilience

  /** Resume the session on a new socket, or (`fresh`, or the resume refused) open a new one. */
  async _recover(fresh) {
    this._recovering = true;
    let delay = this.retryBackoffMs;
    for (let attempt = 0; attempt < this.maxRetries; attempt += 1) {
      if (attempt) {
        await new Promise((resolve) => setTimeout(resolve, delay));
        delay = Math.min(delay * 2, 8000);
      }
      if (this._userClosing) return;
      let answer;
      try {
        answer = await this._reconnectOnce(fresh);
      } catch (err) {
        answer = { failed: err };
      }
      if (this._userClosing) return;
      if (answer.event) {
        this._adopt(answer.event, answer.machine);
        return;
      }
      if (answer.refused === "session_not_found") {
        fresh = true; // expired or forgotten (a restarted server): a new session
        delay = this.retryBackoffMs;
      } else if (answer.refused === "unauthorized") {
        break;
      }
    }
    this._recovering = false;
    this._end(localError("connection_lost", `reconnecting failed after ${this.maxRetries} attempts`, false));
  }

  /** One attempt: dial, read the greeting, send session.resume or session.open, read the answer. */
  _reconnectOnce(fresh) {
    const result = deferred();
    const ws = this._dial();
    this._ws = ws;
    const machine = new ClientMachine(); // the new connection's; it becomes the session's once adopted
    let greeted = false;
    let adopted = false;
    const timer = setTimeout(() => result.resolve({ failed: "timeout" }), this.openTimeoutMs);
    this._handshake = (event) => {
      this._step(machine, event);
      if (event.type === "session.created" && !greeted) {
        greeted = true;
        this.created = event;
        const eventId = this._newId();
        const ask = fresh
          ? { type: "session.open", event_id: eventId, ...this.opened.config }
          : { type: "session.resume", event_id: eventId, session_id: this.sessionId, resume_token: this._resumeToken };
        ws.send(JSON.stringify(machine.send(ask)));
      } else if (event.type === "session.resumed" || event.type === "session.opened") {
        this._handshake = null; // what follows is the session's own traffic
        adopted = true;
        result.resolve({ event, machine });
      } else if (event.type === "error") {
        result.resolve({ refused: event.error && event.error.code });
      } else if (event.type === "session.closed") {
        result.resolve({ refused: `closed:${event.reason}` }); // e.g. the server drains
      }
    };
    const onClose = ws.onclose;
    ws.onclose = (event) => {
      if (adopted) {
        onClose.call(ws, event); // dropped again right after the answer: recover again
        return;
      }
      result.resolve({ refused: "closed" });
    };
    return result.promise.then((answer) => {
      clearTimeout(timer);
      if (answer.event) {
        ws.onclose = onClose;
      } else {
        this._handshake = null;
        ws.onclose = () => {};
        try {
          ws.close(1000);
        } catch {
          // already closed
        }
      }
      return answer;
    });
  }

  /** Carry on with the session on the new socket and its machine; finish or resend the chunk in flight. */
  _adopt(answer, machine) {
    this._recovering = false;
    this._moving = false;
    this.draining = null;
    this.closedEvent = null;
    const turn = this._turn;
    const pending = turn && !turn.finished;
    // The index the chunk in flight has (or gets), by the old machine.
    const expected = turn && turn.ack ? turn.ack.frame_index : this._machine.nextFrameIndex;
    this._machine = machine;
    const ack = () => {
      if (turn.ack === null) turn.ack = { type: "input.ack", frame_index: expected, frame_id: turn.frameId, bytes: 0 };
    };
    const resend = () => {
      try {
        this._send(turn.fields, turn.binaryPayload);
      } catch (err) {
        this._finishTurn(turn, null, err);
      }
    };
    if (answer.type === "session.resumed") {
      this.resumes += 1;
      this._resumeToken = answer.resume_token;
      this.opened = { ...answer, type: "session.opened" };
      if (pending) {
        const missed = answer.missed_response;
        if (missed && missed.frame_index === expected) {
          ack();
          this._finishTurn(turn, missed);
        } else if (answer.in_flight_frame_index === expected) {
          ack(); // the rest of the reply arrives on this socket
        } else if (turn.ack === null) {
          resend();
        } else if (answer.next_frame_index === expected && !turn.resent) {
          // Accepted, then lost with its server (the session store is at the last
          // response.done): the resumed session expects this chunk again. Once only.
          turn.resent = true;
          turn.text = "";
          this.chunksResent += 1;
          console.warn(`vllm-realtime: the reply to chunk ${expected} was lost with its server; sending the chunk again`);
          resend();
          this._emit("resent", { frame_index: expected, frame_id: turn.frameId });
        } else {
          this._finishTurn(turn, null, localError("connection_lost", "the reply in flight was lost with its server", false));
        }
      }
      this._emit("resumed", answer);
    } else {
      this.generation += 1;
      this.opened = answer;
      this._resumeToken = answer.resume_token ?? null;
      if (pending) {
        if (turn.ack === null) resend();
        else this._finishTurn(turn, null, localError("connection_lost", "the reply in flight was lost with the session", false));
      }
      this._emit("reopened", answer);
    }
  }
}

/**
 * The reply to one chunk as it streams (RealtimeClient.streamFrame/streamText/streamAsk), as the
 * Python SDK's ResponseStream: an async iterator of its response.text.delta events, ending at
 * response.done (then in `done`). Iteration throws the RealtimeError of a refused chunk (e.g. a
 * local `chunk_in_flight`), of a timeout (the reply is cancelled) or of the session's end.
 * Leaving the loop early does not cancel the reply (call client.cancel()); the rest still
 * arrives, and `result()` waits for it.
 */
export class ResponseStream {
  constructor(start, onDelta = null) {
    this._start = start;
    this._onDelta = onDelta;
    this._promise = null;
    this._items = [];
    this._wake = null;
    this._over = false;
    this._error = null;
    this._parts = [];
    /** The response.done, once iteration has ended. */
    this.done = null;
  }

  /** The reply's text streamed (yielded) so far. */
  get text() {
    return this._parts.join("");
  }

  /** Whether the chunk has been sent (iteration or result() started). */
  get started() {
    return this._promise !== null;
  }

  _push(item) {
    this._items.push(item);
    if (this._wake) this._wake();
    this._wake = null;
  }

  _launch() {
    const onDelta = (delta, textSoFar, event) => {
      this._push({ delta: event });
      if (this._onDelta) this._onDelta(delta, textSoFar, event);
    };
    let promise;
    try {
      promise = Promise.resolve(this._start(onDelta));
    } catch (err) {
      promise = Promise.reject(err);
    }
    this._promise = promise;
    promise.then(
      (done) => this._push({ done }),
      (error) => this._push({ error }),
    );
  }

  [Symbol.asyncIterator]() {
    return this;
  }

  async next() {
    if (this._over) return { value: undefined, done: true };
    if (this._promise === null) this._launch();
    while (this._items.length === 0) await new Promise((resolve) => (this._wake = resolve));
    const item = this._items.shift();
    if (item.delta) {
      this._parts.push(item.delta.delta);
      return { value: item.delta, done: false };
    }
    this._over = true;
    if (item.error) {
      this._error = item.error;
      throw item.error;
    }
    this.done = item.done;
    return { value: undefined, done: true };
  }

  /** `break` out of `for await`: the reply goes on; result() still waits for it. */
  async return() {
    return { value: undefined, done: true };
  }

  /** Consume the rest of the stream and resolve with its response.done. */
  async result() {
    for (;;) {
      const step = await this.next();
      if (step.done) break;
    }
    if (this._error) throw this._error;
    if (this.done === null) throw localError("session_closed", "the reply ended without a response.done", false);
    return this.done;
  }
}

export default RealtimeClient;
