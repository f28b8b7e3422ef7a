// Type declarations for realtime-client.js (the vllm-realtime wire protocol, docs/protocol.md).

export declare const PROTOCOL_VERSION: "2026-12-01";
export declare const SUBPROTOCOL: "vllm-realtime";
export declare const AUTH_SUBPROTOCOL_PREFIX: "vllm-realtime.auth.";

// ---------------------------------------------------------------- session settings

export type Modality = "video" | "text";
export type FrameFormat = "jpeg" | "png" | "webp" | "auto";
export type ResponseStatus = "completed" | "cancelled" | "failed" | "incomplete" | "ingested";
export type CloseReason =
  | "client_closed"
  | "disconnect"
  | "idle_timeout"
  | "engine_error"
  | "server_shutdown"
  | "error"
  | "expired";
export type ErrorType =
  | "invalid_request_error"
  | "capacity_error"
  | "auth_error"
  | "server_error"
  | "timeout_error";
export type MediaFormat = "jpeg" | "png" | "webp" | "mp4" | "webm";

export interface RetentionConfig {
  enabled?: boolean;
  sink_tokens?: number;
  sink_chunks?: number;
  /** Most recent chunks kept; null: no chunk cap. Default 8. */
  window_chunks?: number | null;
  window_tokens?: number | null;
  /** Own token budget for questions, text turns and replies; null: text leaves with its frames. */
  text_window_tokens?: number | null;
}

/** OpenAI's response_format shape. */
export type ResponseFormat =
  | { type: "json_schema"; json_schema: { name: string; description?: string | null; schema: Record<string, unknown>; strict?: boolean | null } }
  | { type: "json_object" }
  | { type: "text" };

export interface SamplingConfig {
  max_tokens?: number;
  temperature?: number;
  top_p?: number;
  seed?: number | null;
  /** Constrain every reply (structured outputs); null: free text. */
  response_format?: ResponseFormat | null;
}

/** Opt-in resumption: a dropped connection parks the session this long (capped by the server). */
export interface ResumableConfig {
  grace_s: number;
}

/** What `open()` sends (every field optional; the server fills defaults). */
export interface SessionConfig {
  instructions?: string | null;
  modality?: Modality;
  retention?: RetentionConfig;
  sampling?: SamplingConfig;
  frame_format?: FrameFormat;
  model?: string | null;
  /** Makes the session resilient (resumes after drops, moves on after drains). */
  resumable?: ResumableConfig | null;
}

/** The effective settings echoed in session.opened: every field present. */
export interface EffectiveSessionConfig {
  instructions: string | null;
  modality: Modality;
  retention: Required<RetentionConfig>;
  sampling: Required<SamplingConfig>;
  frame_format: FrameFormat;
  model: string | null;
  resumable: ResumableConfig | null;
}

// ---------------------------------------------------------------- server events

export interface Limits {
  max_frame_bytes: number;
  max_event_bytes: number;
  max_sessions: number;
  idle_timeout_s: number;
  max_tokens_cap: number;
  /** Cap on resumable.grace_s; 0: no session is resumable. */
  max_resume_grace_s: number;
  server_version: string;
  model: string;
  protocol_version: string;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
}

/** Milliseconds from acceptance; null where not measured. */
export interface Timing {
  queue_ms: number | null;
  ttft_ms: number | null;
  total_ms: number | null;
}

/** The session's context after a reply. */
export interface RetentionState {
  frames_retained: number;
  frames_evicted: number;
  tokens_retained: number;
  kv_blocks_held: number;
  consolidations: number;
}

export interface ErrorDetail {
  type: ErrorType;
  code: string;
  message: string;
  event_id: string | null;
  session_survives: boolean;
}

interface ServerEventBase {
  event_id: string;
}

export interface SessionCreatedEvent extends ServerEventBase {
  type: "session.created";
  session_id: string;
  limits: Limits;
}

export interface SessionOpenedEvent extends ServerEventBase {
  type: "session.opened";
  session_id: string;
  config: EffectiveSessionConfig;
  limits: Limits;
  /** Secret for session.resume; null unless the session is resumable. */
  resume_token: string | null;
}

export interface InputAckEvent extends ServerEventBase {
  type: "input.ack";
  frame_index: number;
  frame_id: string | null;
  bytes: number;
}

export interface ResponseCreatedEvent extends ServerEventBase {
  type: "response.created";
  frame_index: number;
  frame_id: string | null;
}

export interface ResponseTextDeltaEvent extends ServerEventBase {
  type: "response.text.delta";
  frame_index: number;
  delta: string;
}

export interface ResponseDoneEvent extends ServerEventBase {
  type: "response.done";
  frame_index: number;
  frame_id: string | null;
  status: ResponseStatus;
  status_reason: string | null;
  text: string;
  usage: Usage;
  timing: Timing;
  retention: RetentionState;
}

export interface SessionClosedEvent extends ServerEventBase {
  type: "session.closed";
  session_id: string;
  reason: CloseReason;
  frames_total: number;
}

export interface SessionResumedEvent extends ServerEventBase {
  type: "session.resumed";
  session_id: string;
  config: EffectiveSessionConfig;
  limits: Limits;
  next_frame_index: number;
  /** A chunk whose reply still runs: its response.done follows on this connection. */
  in_flight_frame_index: number | null;
  /** The response.done that finished while no connection was attached. */
  missed_response: ResponseDoneEvent | null;
  /** The new token (the old one no longer works). */
  resume_token: string;
  /** True: rebuilt on this server from the session store (its old server is gone). */
  rebuilt?: boolean;
  /** Tokens of the retained context re-prefilled by the rebuild (0: not rebuilt). */
  reprefilled_tokens?: number;
}

export interface ServerDrainingEvent extends ServerEventBase {
  type: "server.draining";
  seconds_left: number;
}

export interface ErrorEvent extends ServerEventBase {
  type: "error";
  error: ErrorDetail;
}

export type ServerEvent =
  | SessionCreatedEvent
  | SessionOpenedEvent
  | InputAckEvent
  | ResponseCreatedEvent
  | ResponseTextDeltaEvent
  | ResponseDoneEvent
  | SessionClosedEvent
  | SessionResumedEvent
  | ServerDrainingEvent
  | ErrorEvent;

export type ServerEventType = ServerEvent["type"];
export type ServerEventOf<T extends ServerEventType> = Extract<ServerEvent, { type: T }>;

// ---------------------------------------------------------------- errors

/**
 * A server `error` event (`local: false`, `code` is a wire code such as `chunk_in_flight`), or
 * a client-side failure (`local: true`; codes `chunk_in_flight`, `session_not_open`,
 * `session_already_open`, `undecodable_frame`, `frame_too_large`, `timeout`,
 * `connection_failed`, `connection_lost`, `session_closed`, `reconnecting`).
 */
export declare class RealtimeError extends Error {
  constructor(
    code: string,
    message: string,
    options?: { type?: ErrorType | "client_error"; sessionSurvives?: boolean; eventId?: string | null; local?: boolean },
  );
  readonly code: string;
  readonly type: ErrorType | "client_error";
  readonly sessionSurvives: boolean;
  readonly eventId: string | null;
  readonly local: boolean;
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
  /** Sent as the subprotocol `vllm-realtime.auth.<key>`. */
  apiKey?: string | null;
  /** Needed where there is no global WebSocket (Node 20): e.g. `(await import("ws")).WebSocket`. */
  WebSocket?: WebSocketConstructor | (new (url: string, protocols?: string | string[]) => any);
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

export declare class RealtimeClient {
  /** Connect and wait for session.created. */
  static connect(url: string, options?: ClientOptions): Promise<RealtimeClient>;
  constructor(url: string, options?: ClientOptions);

  readonly url: string;
  timeoutMs: number;
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
  readonly closed: boolean;
  /** Opened with `resumable` (granted): resumes after drops, moves on after drains. */
  readonly resilient: boolean;
  /** Reconnecting, or the server drains: no chunk goes out (offerFrame drops). */
  readonly holding: boolean;
  /** 1, then +1 for every new session opened after a drain or a refused resume. */
  readonly generation: number;
  /** Successful session.resume so far. */
  readonly resumes: number;
  /** The last server.draining of the current connection. */
  readonly draining: ServerDrainingEvent | null;

  on<T extends ServerEventType>(type: T, listener: (event: ServerEventOf<T>) => void): () => void;
  on(type: "event", listener: (event: ServerEvent) => void): () => void;
  on(type: "close", listener: (info: { code?: number; reason?: string }) => void): () => void;
  /** The session continued on a new connection (session.resume succeeded). */
  on(type: "resumed", listener: (event: SessionResumedEvent) => void): () => void;
  /** A new session replaced the old one (after a drain, or a refused resume). */
  on(type: "reopened", listener: (event: SessionOpenedEvent) => void): () => void;

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
  cancel(): Promise<ResponseDoneEvent | null>;
  close(options?: { timeoutMs?: number }): Promise<SessionClosedEvent | null>;
}

export declare function sniffMedia(bytes: Uint8Array): MediaFormat | null;

export default RealtimeClient;
