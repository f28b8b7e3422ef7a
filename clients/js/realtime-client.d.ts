// Type declarations for realtime-client.js. The wire types (events, configs, limits, error codes)
// come from protocol.d.ts, which `make types` generates from protocol/ (pydantic's JSON Schema)
// and tests/clients/test_types_drift.py checks; only the client's own API is written here.

import type {
  EffectiveSessionConfig,
  ErrorCode,
  ErrorDetail,
  Limits,
  ResponseDoneEvent,
  ResponseTextDeltaEvent,
  SamplingConfig,
  ServerDrainingEvent,
  ServerEvent,
  SessionClosedEvent,
  SessionConfig,
  SessionCreatedEvent,
  SessionOpenedEvent,
  SessionResumedEvent,
  SessionUpdatedEvent,
} from "./protocol.js";

export type * from "./protocol.js";

export declare const PROTOCOL_VERSION: "2026-12-01";
export declare const SUBPROTOCOL: "vllm-realtime";
export declare const AUTH_SUBPROTOCOL_PREFIX: "vllm-realtime.auth.";

// ---------------------------------------------------------------- names for wire fields

export type Modality = NonNullable<SessionConfig["modality"]>;
export type FrameFormat = NonNullable<SessionConfig["frame_format"]>;
export type ResponseFormat = NonNullable<SamplingConfig["response_format"]>;
export type ResponseStatus = ResponseDoneEvent["status"];
export type CloseReason = SessionClosedEvent["reason"];
export type ErrorType = ErrorDetail["type"];
/** What sniffMedia() recognises (the server sniffs the same formats). */
export type MediaFormat = "jpeg" | "png" | "webp" | "mp4" | "webm";
/** Errors the client raises itself (`local: true`), besides the wire's ErrorCode. */
export type LocalErrorCode =
  | "chunk_in_flight"
  | "session_not_open"
  | "session_already_open"
  | "undecodable_frame"
  | "frame_too_large"
  | "timeout"
  | "connection_failed"
  | "connection_lost"
  | "session_closed"
  | "reconnecting";

export type ServerEventType = ServerEvent["type"];
export type ServerEventOf<T extends ServerEventType> = Extract<ServerEvent, { type: T }>;

// ---------------------------------------------------------------- errors

/**
 * A server `error` event (`local: false`, `code` is a wire code such as `chunk_in_flight`), or
 * a client-side failure (`local: true`; codes `chunk_in_flight`, `session_not_open`,
 * `session_already_open`, `undecodable_frame`, `frame_too_large`, `timeout`,
 * `connection_failed`, `connection_lost`, `session_closed`, `reconnecting`; and whatever
 * other refusal of the protocol's tables ClientMachine raises, with the server's wire code,
 * e.g. `no_response_in_flight`, or `internal_error` for a server event out of order).
 */
export declare class RealtimeError extends Error {
  constructor(
    code: ErrorCode | LocalErrorCode,
    message: string,
    options?: {
      type?: ErrorType | "client_error";
      sessionSurvives?: boolean;
      eventId?: string | null;
      local?: boolean;
      param?: string | null;
    },
  );
  readonly code: ErrorCode | LocalErrorCode;
  readonly type: ErrorType | "client_error";
  readonly sessionSurvives: boolean;
  readonly eventId: string | null;
  readonly local: boolean;
  /** The offending field of the client event, as a dotted path; null: none named. */
  readonly param: string | null;
  static fromDetail(detail: ErrorDetail): RealtimeError;
}

// ---------------------------------------------------------------- the client

/** The subset of the WHATWG WebSocket the client uses (browsers, Node 22+, the `ws` package). */
export interface WebSocketLike {
  readonly readyState: number;
  readonly protocol: string;
  binaryType: string;
  send(data: string | ArrayBufferLike | ArrayBufferView): void;
  close(code?: number, reason?: string): void;
  onopen: ((event: any) => void) | null;
  onmessage: ((event: { data: any }) => void) | null;
  onerror: ((event: any) => void) | null;
  onclose: ((event: { code?: number; reason?: string }) => void) | null;
}

export type WebSocketConstructor = new (url: string, protocols?: string | string[]) => WebSocketLike;

export interface ClientOptions {
  /** The API key (or a client secret); where it goes: `apiKeyIn`. */
  apiKey?: string | null;
  /**
   * "header": `Authorization: Bearer <key>` in the handshake (the default in Node: Node's own
   * WebSocket takes `{ protocols, headers }`, the `ws` package `(url, protocols, { headers })`).
   * "subprotocol": offered as `vllm-realtime.auth.<key>` (the default in browsers, which
   * cannot set headers).
   */
  apiKeyIn?: "header" | "subprotocol";
  /** Needed where there is no global WebSocket (Node 20): e.g. `(await import("ws")).WebSocket`. */
  WebSocket?: WebSocketConstructor | (new (url: string, protocols?: any, options?: any) => any);
  /** Default per reply (send → response.done), and for open(); 0 waits forever. Default 60000. */
  timeoutMs?: number;
  /** Handshake + session.created. Default 10000. */
  openTimeoutMs?: number;
  /** Called with every server event, in order. */
  onEvent?: (event: ServerEvent) => void;
  /** Connection attempts of a resilient session to resume or reopen. Default 8. */
  maxRetries?: number;
  /** Wait before the second attempt, doubled each time up to 8 s. Default 500. */
  retryBackoffMs?: number;
}

export type FrameData = Blob | ArrayBuffer | ArrayBufferView | string;

export interface ChunkOptions {
  prompt?: string | null;
  frameId?: string | null;
  /** Capture time in seconds. */
  timestamp?: number | null;
  timeoutMs?: number;
  /** Called for each text delta with the text so far. */
  onDelta?: (delta: string, textSoFar: string, event: ResponseTextDeltaEvent) => void;
  /** This reply's format, overriding the session's `sampling.response_format`. */
  responseFormat?: ResponseFormat | null;
}

export interface FrameOptions extends ChunkOptions {
  /** true (default): a binary WebSocket message; false: base64 in the JSON event. */
  binary?: boolean;
  /** false: watch only (prefill, no reply; response.done status "ingested"). Default true. */
  reply?: boolean;
}

export interface ClientStats {
  framesSent: number;
  replies: number;
  /** Frames offerFrame() dropped because a chunk was in flight. */
  dropped: number;
  errors: number;
}

/**
 * The reply to one chunk as it streams: `for await (const delta of stream)` yields its
 * response.text.delta events and ends at response.done (then in `done`). The chunk is sent when
 * iteration (or `result()`) starts. A refused chunk, a timeout or the session's end is thrown
 * from the loop as a RealtimeError. Leaving the loop early does not cancel the reply.
 */
export declare class ResponseStream implements AsyncIterableIterator<ResponseTextDeltaEvent> {
  /** The response.done, once iteration has ended. */
  readonly done: ResponseDoneEvent | null;
  /** The reply's text streamed so far. */
  readonly text: string;
  /** The chunk has been sent. */
  readonly started: boolean;
  [Symbol.asyncIterator](): ResponseStream;
  next(): Promise<IteratorResult<ResponseTextDeltaEvent, undefined>>;
  return(): Promise<IteratorResult<ResponseTextDeltaEvent, undefined>>;
  /** Consume the rest of the stream and resolve with its response.done. */
  result(): Promise<ResponseDoneEvent>;
}

// ---------------------------------------------------------------- the protocol's machine

/** A session's state in the protocol's tables (protocol/vllm_realtime_protocol/tables.py, `State`). */
export type SessionState =
  | "connected"
  | "idle"
  | "awaiting_binary"
  | "awaiting_response"
  | "closed"
  | "parked"
  | "parked_awaiting_response";
/**
 * An input of the tables: a client event's type ("frame.append(binary)" for a frame.append
 * with `binary: true`, "binary" for its payload) or a server happening ("response_done", ...).
 */
export type MachineInput = string;
/** The transition tables as rows: protocol.tables.json, generated by `make types`. */
export interface ProtocolTables {
  transitions: [SessionState, MachineInput, SessionState][];
  refusals: [SessionState, MachineInput, ErrorCode][];
  client_inputs: [MachineInput][];
  refused_payload_state: [MachineInput, SessionState][];
}
/** The tables the client runs on (a copy of protocol.tables.json). */
export declare const PROTOCOL_TABLES: ProtocolTables;
/** A sent input the server has not answered yet, and the state before it. */
export interface UnansweredSend {
  input: MachineInput;
  before: SessionState;
  eventId: string | null;
}
/** What ClientMachine needs of a client event. */
export interface ClientEventLike {
  type: string;
  event_id?: string | null;
  binary?: boolean | null;
}

/**
 * A session's state as the client sees it, stepped through the protocol's tables (the Python
 * ClientProtocol's rules): `send` throws the server's own refusal (a local RealtimeError with
 * the wire code) where the tables refuse; `receive` applies a server event. No I/O.
 */
export declare class ClientMachine {
  constructor(tables?: ProtocolTables);
  static inputOf(event: ClientEventLike): MachineInput;
  state: SessionState;
  /** A chunk is in flight: sent (or announced), its response.done not received. */
  readonly busy: boolean;
  unanswered: UnansweredSend[];
  sessionId: string | null;
  limits: Limits | null;
  config: EffectiveSessionConfig | null;
  /** The frame_index the server gives the next accepted chunk. */
  nextFrameIndex: number;
  inFlightFrameIndex: number | null;
  resumeToken: string | null;
  closeReason: CloseReason | null;
  /** Throw the server's refusal of `event` in this state; nothing changes either way. */
  check(event: ClientEventLike): void;
  send<E extends ClientEventLike>(event: E): E;
  sendBinary<D>(data: D): D;
  receive(event: ServerEvent): void;
  /** The connection is gone: a resumable open session is parked, any other ends. */
  connectionLost(): void;
}

export declare class RealtimeClient {
  /** Connect and wait for session.created. */
  static connect(url: string, options?: ClientOptions): Promise<RealtimeClient>;
  constructor(url: string, options?: ClientOptions);

  readonly url: string;
  timeoutMs: number;
  /** Where the API key travels (see ClientOptions.apiKeyIn). */
  readonly apiKeyIn: "header" | "subprotocol";
  /** Settles on session.created (rejects with a RealtimeError, e.g. `connection_failed`). */
  readonly ready: Promise<RealtimeClient>;
  readonly created: SessionCreatedEvent | null;
  readonly opened: SessionOpenedEvent | null;
  readonly closedEvent: SessionClosedEvent | null;
  /** The error that ended the session, if one did. */
  readonly fatal: RealtimeError | null;
  /** Surviving errors that answered no pending call (newest last, at most 64). */
  readonly errors: RealtimeError[];
  readonly stats: ClientStats;

  readonly sessionId: string | null;
  readonly limits: Limits | null;
  readonly config: EffectiveSessionConfig | null;
  /** A chunk is in flight (or being prepared). */
  readonly busy: boolean;
  /** The session's protocol machine (its turn state, by the protocol's tables). */
  readonly machine: ClientMachine;
  readonly closed: boolean;
  /** Opened with `resumable` (granted): resumes after drops, moves on after drains. */
  readonly resilient: boolean;
  /** Reconnecting, or the server drains: no chunk goes out (offerFrame drops). */
  readonly holding: boolean;
  /** 1, then +1 for every new session opened after a drain or a refused resume. */
  readonly generation: number;
  /** Successful session.resume so far. */
  readonly resumes: number;
  /** Accepted chunks sent again after a resume, their reply lost with the server that ran it. */
  readonly chunksResent: number;
  /** The last server.draining of the current connection. */
  readonly draining: ServerDrainingEvent | null;

  on<T extends ServerEventType>(type: T, listener: (event: ServerEventOf<T>) => void): () => void;
  on(type: "event", listener: (event: ServerEvent) => void): () => void;
  on(type: "close", listener: (info: { code?: number; reason?: string }) => void): () => void;
  /** The session continued on a new connection (session.resume succeeded). */
  on(type: "resumed", listener: (event: SessionResumedEvent) => void): () => void;
  /** A new session replaced the old one (after a drain, or a refused resume). */
  on(type: "reopened", listener: (event: SessionOpenedEvent) => void): () => void;
  /** An accepted chunk whose reply was lost with its server was sent again (once). */
  on(type: "resent", listener: (info: { frame_index: number; frame_id: string | null }) => void): () => void;

  /** session.update: later chunks use these settings; resolves with session.updated. */
  update(options: { sampling?: SamplingConfig; frameFormat?: FrameFormat }): Promise<SessionUpdatedEvent>;
  open(config?: SessionConfig): Promise<SessionOpenedEvent>;
  appendFrame(data: FrameData, options?: FrameOptions): Promise<ResponseDoneEvent>;
  appendText(text: string, options?: ChunkOptions): Promise<ResponseDoneEvent>;
  /** Watch a frame without a reply: resolves with a response.done of status "ingested". */
  ingestFrame(data: FrameData, options?: Omit<FrameOptions, "reply" | "responseFormat">): Promise<ResponseDoneEvent>;
  /** Ask a question between frames; stream the answer with onDelta. */
  ask(question: string, options?: ChunkOptions): Promise<ResponseDoneEvent>;
  /** Send if idle, else drop (counted in stats.dropped) and resolve null. */
  offerFrame(
    data: FrameData | (() => FrameData | Promise<FrameData>),
    options?: FrameOptions,
  ): Promise<ResponseDoneEvent | null>;
  /** Send a frame and stream its reply: `for await (const delta of client.streamFrame(jpeg))`. */
  streamFrame(data: FrameData, options?: FrameOptions): ResponseStream;
  /** A text turn, streamed. */
  streamText(text: string, options?: ChunkOptions): ResponseStream;
  /** A question between frames, its answer streamed. */
  streamAsk(question: string, options?: ChunkOptions): ResponseStream;
  /** Every server event from now on until the session ends; `break` unsubscribes. */
  events(): AsyncIterableIterator<ServerEvent>;
  /** `for await (const event of client)`: as events(). */
  [Symbol.asyncIterator](): AsyncIterableIterator<ServerEvent>;
  cancel(): Promise<ResponseDoneEvent | null>;
  close(options?: { timeoutMs?: number }): Promise<SessionClosedEvent | null>;
}

export declare function sniffMedia(bytes: Uint8Array): MediaFormat | null;

export default RealtimeClient;
