"""Wire events of the vllm-realtime protocol, one pydantic model per event.

Every message on the WebSocket (except a binary frame payload) is one JSON
object with a ``type`` field naming the event.  Client events (client → server)
refuse unknown fields and are validated strictly (no ``"64"`` for ``64``);
server events (server → client) ignore unknown fields so that older clients
keep working when the server grows a field.

Every event carries an optional ``event_id``.  The client may set one on its
events; an ``error`` answering that event echoes it in ``error.event_id``.
Server events always carry one, generated as ``evt_`` + 24 hex characters.

``ClientEvent`` and ``ServerEvent`` are discriminated unions (on ``type``) and
``CLIENT_EVENT_ADAPTER`` / ``SERVER_EVENT_ADAPTER`` validate them; the codec
(:mod:`vllm_realtime_protocol.codec`) is the intended entry point for wire bytes.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator
from pydantic_core import PydanticCustomError

from vllm_realtime_protocol.constants import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    MAX_EVENT_ID_CHARS,
    PROTOCOL_VERSION,
)

__all__ = [
    "CLIENT_EVENT_ADAPTER",
    "CLIENT_EVENT_TYPES",
    "SERVER_EVENT_ADAPTER",
    "SERVER_EVENT_TYPES",
    "ClientEvent",
    "ClientSecret",
    "ClientSecretRequest",
    "CloseReason",
    "ErrorDetail",
    "ErrorEvent",
    "ErrorType",
    "FrameAppendEvent",
    "FrameFormat",
    "InputAckEvent",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "Limits",
    "Modality",
    "ResponseCancelEvent",
    "ResponseCreatedEvent",
    "ResponseDoneEvent",
    "ResponseFormat",
    "ResponseStatus",
    "ResponseTextDeltaEvent",
    "ResumableConfig",
    "RetentionConfig",
    "RetentionState",
    "SamplingConfig",
    "ServerDrainingEvent",
    "ServerEvent",
    "SessionCloseEvent",
    "SessionClosedEvent",
    "SessionConfig",
    "SessionCreatedEvent",
    "SessionOpenEvent",
    "SessionOpenedEvent",
    "SessionResumeEvent",
    "SessionResumedEvent",
    "TextFormat",
    "Timing",
    "Usage",
    "new_event_id",
    "new_session_id",
]

Modality: TypeAlias = Literal["video", "text"]
FrameFormat: TypeAlias = Literal["jpeg", "png", "webp", "auto"]
ResponseStatus: TypeAlias = Literal["completed", "cancelled", "failed", "incomplete", "ingested"]
CloseReason: TypeAlias = Literal[
    "client_closed",
    "disconnect",
    "idle_timeout",
    "engine_error",
    "server_shutdown",
    "error",
    "expired",
]
ErrorType: TypeAlias = Literal[
    "invalid_request_error", "capacity_error", "auth_error", "server_error", "timeout_error"
]


def new_event_id() -> str:
    """Return a fresh server event id: ``evt_`` followed by 24 random hex characters."""
    return "evt_" + secrets.token_hex(12)


def new_session_id() -> str:
    """Return a fresh session id: ``sess_`` followed by 32 random hex characters (128 bits: an
    id is all that names an HTTP session of a server without API keys, so it is unguessable)."""
    return "sess_" + secrets.token_hex(16)


# --------------------------------------------------------------------------- bases


class _Inbound(BaseModel):
    """Base of everything a client sends: strict, closed, immutable."""

    # Echoed back with every default filled in (session.opened's config): the generated schema
    # describes that echo as "Effective<Model>" with every field present (vllm_realtime_protocol/schema.py).
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, json_schema_serialization_defaults_required=True
    )


class _Outbound(BaseModel):
    """Base of everything the server sends: unknown fields ignored, immutable."""

    # Every field is on the wire when the server sends it, defaults included: the generated
    # schema (vllm_realtime_protocol/schema.py) and the TypeScript types from it say so.
    model_config = ConfigDict(
        extra="ignore", frozen=True, json_schema_serialization_defaults_required=True
    )


_EVENT_ID_DOC = "Client-chosen id of this event; echoed in error.event_id if it fails."


class _ClientEventBase(_Inbound):
    """Fields every client event has; subclasses narrow ``type`` to a Literal."""

    type: str = Field(description="Event type.")
    event_id: str | None = Field(
        default=None, max_length=MAX_EVENT_ID_CHARS, description=_EVENT_ID_DOC
    )


class _ServerEventBase(_Outbound):
    """Fields every server event has; subclasses narrow ``type`` to a Literal."""

    type: str = Field(description="Event type.")
    event_id: str = Field(
        default_factory=new_event_id,
        description="Server-generated id of this event (evt_ + 24 hex characters).",
    )


# --------------------------------------------------------------------------- session config


class RetentionConfig(_Inbound):
    """What the server keeps of the long-lived request's context (the KV cache).

    The context is a *sink* (the first chunks or tokens, kept forever) followed
    by a sliding *window* of the most recent chunks; older chunks are evicted.
    Low/high watermarks for eviction are chosen server-side.
    """

    enabled: bool = Field(
        default=True,
        description="Evict old chunks; false keeps everything until the context is full.",
    )
    sink_tokens: int = Field(
        default=0, ge=0, description="Leading tokens (after the instructions) kept forever."
    )
    sink_chunks: int = Field(default=1, ge=0, description="First N chunks kept forever.")
    window_chunks: int | None = Field(
        default=8, ge=1, description="Most recent chunks kept in the sliding window; null: no cap."
    )
    window_tokens: int | None = Field(
        default=None, ge=1, description="Token cap on the sliding window; null: no cap."
    )
    text_window_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Own token budget for questions, text turns and replies (kept apart from "
        "the frames' window); null: text leaves with its frames.",
    )

    @model_validator(mode="after")
    def _window_is_bounded(self) -> RetentionConfig:
        if self.enabled and self.window_chunks is None and self.window_tokens is None:
            raise PydanticCustomError(
                "unbounded_window",
                "retention.enabled needs window_chunks or window_tokens "
                "(or set enabled: false to keep everything)",
            )
        return self


class JsonSchemaSpec(_Inbound):
    """The ``json_schema`` of a ``json_schema`` response format (OpenAI's shape)."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, populate_by_name=True, serialize_by_alias=True
    )

    name: str = Field(min_length=1, max_length=64, description="Name of the schema.")
    description: str | None = Field(default=None, description="What the schema describes.")
    # `schema` would shadow BaseModel.schema: the attribute is schema_, the wire name "schema".
    schema_: dict[str, object] = Field(
        alias="schema", description="A JSON Schema (an object) every reply must validate against."
    )
    strict: bool | None = Field(
        default=None, description="Accepted for OpenAI compatibility; replies are always strict."
    )


class JsonSchemaFormat(_Inbound):
    """``{"type": "json_schema", "json_schema": {...}}``: replies are JSON valid against it."""

    type: Literal["json_schema"] = Field(description="Response format kind.")
    json_schema: JsonSchemaSpec = Field(description="The schema and its name.")


class JsonObjectFormat(_Inbound):
    """``{"type": "json_object"}``: replies are one JSON object (any keys)."""

    type: Literal["json_object"] = Field(description="Response format kind.")


class TextFormat(_Inbound):
    """``{"type": "text"}``: free text (the default); turns a session's format off for a chunk."""

    type: Literal["text"] = Field(description="Response format kind.")


ResponseFormat: TypeAlias = Annotated[
    JsonSchemaFormat | JsonObjectFormat | TextFormat, Field(discriminator="type")
]
"""How replies are constrained, in OpenAI's ``response_format`` shape."""


class SamplingConfig(_Inbound):
    """Sampling parameters applied to every reply of the session."""

    max_tokens: int = Field(
        default=64, ge=1, le=4096, description="Most tokens generated per reply (capped by limits)."
    )
    temperature: float = Field(
        default=0.0, ge=0.0, le=2.0, allow_inf_nan=False, description="Sampling temperature."
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass."
    )
    seed: int | None = Field(
        default=None, description="Seed for reproducible sampling; null: random."
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description="Constrain every reply (json_schema | json_object | text); null: free text.",
    )


class ResumableConfig(_Inbound):
    """Opt-in resumption: a dropped connection parks the session instead of ending it."""

    grace_s: float = Field(
        gt=0,
        allow_inf_nan=False,
        description="Seconds a dropped session waits for session.resume (capped by the server).",
    )


class ChunkLimits(_Inbound):
    """What a session declares it sends: caps on its chunks (at or below the server's
    ``limits``) and its pace.

    Admission reserves KV for the largest chunk a session may send and engine time for its
    frames per second; lower caps and a slower pace reserve less, so more sessions fit. A chunk
    over a cap is refused with ``chunk_too_large``. A session that declares nothing sends single
    images (or text) at one chunk a second."""

    max_chunk_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens of one chunk's text (a text turn, or a frame's prompt, template "
        "included); null: the server's limits.max_chunk_tokens.",
    )
    max_clip_frames: int = Field(
        default=1,
        ge=1,
        description="Most frames of one video clip (an image counts as one), at most the "
        "server's limits.max_clip_frames; 1: single images only.",
    )
    max_frame_pixels: int | None = Field(
        default=None,
        ge=1,
        description="Most pixels (width × height) of one image or clip frame, at most the "
        "server's limits.max_frame_pixels; a larger one is resized down to it (response.done "
        "says so). Admission reserves a frame's tokens from it; null: the server's cap.",
    )
    frames_per_s: float = Field(
        default=1.0,
        gt=0.0,
        le=1000.0,
        allow_inf_nan=False,
        description="Chunks per second this session sends at most: admission reserves engine "
        "time for this pace (1.0: a camera's pace).",
    )


class SessionConfig(_Inbound):
    """Settings of a session; sent in session.open and echoed, resolved, in session.opened."""

    instructions: str | None = Field(
        default=None, description="Task / system prompt placed before the first chunk."
    )
    modality: Modality = Field(
        default="video", description="'video': image/clip/binary frames; 'text': text turns."
    )
    retention: RetentionConfig = Field(
        default_factory=RetentionConfig, description="What the server keeps of the context."
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Sampling parameters for every reply."
    )
    frame_format: FrameFormat = Field(
        default="auto", description="Required image format of frames; 'auto' sniffs each one."
    )
    model: str | None = Field(
        default=None, description="Model to use; null: the server's model (see limits.model)."
    )
    resumable: ResumableConfig | None = Field(
        default=None,
        description="Park the session for grace_s when the connection drops; null: end it.",
    )
    limits: ChunkLimits = Field(
        default_factory=ChunkLimits,
        description="Caps on this session's chunks (at or below the server's): a smaller KV "
        "reservation.",
    )


# --------------------------------------------------------------------------- client events


class SessionOpenEvent(SessionConfig):
    """``session.open``: start the one long-lived session of this connection."""

    type: Literal["session.open"] = Field(default="session.open", description="Event type.")
    event_id: str | None = Field(
        default=None, max_length=MAX_EVENT_ID_CHARS, description=_EVENT_ID_DOC
    )

    def session_config(self) -> SessionConfig:
        """Return the requested settings as a plain :class:`SessionConfig`."""
        return SessionConfig(
            instructions=self.instructions,
            modality=self.modality,
            retention=self.retention,
            sampling=self.sampling,
            frame_format=self.frame_format,
            model=self.model,
            resumable=self.resumable,
            limits=self.limits,
        )


_PAYLOAD_FIELDS = ("image", "text", "video", "binary")


class FrameAppendEvent(_ClientEventBase):
    """``frame.append``: one chunk (frame, clip or text turn); the server replies once.

    Exactly one payload: ``image``, ``text``, ``video``, or ``binary: true``
    (the payload is then the next binary WebSocket message).
    """

    type: Literal["frame.append"] = Field(default="frame.append", description="Event type.")
    image: str | None = Field(
        default=None, min_length=1, description="Base64 of one JPEG, PNG or WebP image."
    )
    text: str | None = Field(default=None, min_length=1, description="A text turn.")
    video: str | None = Field(
        default=None, min_length=1, description="Base64 of a short clip (MP4 or WebM)."
    )
    binary: bool = Field(
        default=False, description="True: the payload is the next binary WebSocket message."
    )
    prompt: str | None = Field(default=None, description="Prompt for this chunk only.")
    timestamp: float | None = Field(
        default=None, allow_inf_nan=False, description="Capture time of the chunk, in seconds."
    )
    frame_id: str | None = Field(
        default=None,
        max_length=MAX_EVENT_ID_CHARS,
        description="Client's label for the chunk; echoed in input.ack and response events.",
    )
    reply: bool = Field(
        default=True,
        description="False: prefill the chunk only; response.done says 'ingested', no text.",
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description="This chunk's reply format, overriding sampling.response_format.",
    )

    @model_validator(mode="after")
    def _exactly_one_payload(self) -> FrameAppendEvent:
        given = [name for name in _PAYLOAD_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            got = "none" if not given else " and ".join(repr(name) for name in given)
            raise PydanticCustomError(
                "payload_count",
                "frame.append needs exactly one payload: 'image', 'text', 'video' "
                "or 'binary': true (got {got})",
                {"got": got},
            )
        if not self.reply and self.response_format is not None:
            raise PydanticCustomError(
                "format_without_reply",
                "frame.append.response_format needs a reply; drop it or set reply: true",
            )
        return self

    @property
    def payload_kind(self) -> Literal["image", "text", "video", "binary"]:
        """Which of the four payload fields is set."""
        if self.image is not None:
            return "image"
        if self.text is not None:
            return "text"
        if self.video is not None:
            return "video"
        return "binary"


class ResponseCancelEvent(_ClientEventBase):
    """``response.cancel``: stop the reply in flight; its response.done says 'cancelled'."""

    type: Literal["response.cancel"] = Field(default="response.cancel", description="Event type.")


class SessionResumeEvent(_ClientEventBase):
    """``session.resume``: take over a resumable session, as the first event of a connection."""

    type: Literal["session.resume"] = Field(default="session.resume", description="Event type.")
    session_id: str = Field(
        min_length=1, max_length=MAX_EVENT_ID_CHARS, description="Id of the session to resume."
    )
    resume_token: str = Field(
        min_length=1,
        max_length=MAX_EVENT_ID_CHARS,
        description="The resume_token of session.opened (or of the last session.resumed).",
    )


class SessionCloseEvent(_ClientEventBase):
    """``session.close``: end the session; the server answers session.closed and closes."""

    type: Literal["session.close"] = Field(default="session.close", description="Event type.")


FIXED_SETTINGS: tuple[str, ...] = ("instructions", "modality", "retention", "resumable", "limits")
"""Settings ``session.update`` refuses to change: they live in the KV cache (instructions,
retention), the admission reservation (limits, retention) or the session's kind."""


class SessionUpdateEvent(_ClientEventBase):
    """``session.update``: change settings of the open session from its next chunk on.

    ``sampling`` is merged field by field into the session's (only the fields sent change);
    ``frame_format`` replaces it. The reply in flight, if any, keeps the settings it started
    with. The settings in :data:`FIXED_SETTINGS` cannot change (``invalid_request`` naming the
    field): open a new session for those."""

    type: Literal["session.update"] = Field(default="session.update", description="Event type.")
    sampling: SamplingConfig | None = Field(
        default=None,
        description="Sampling fields to change (the others keep their value); null: unchanged.",
    )
    frame_format: FrameFormat | None = Field(
        default=None, description="Required image format of frames from now on; null: unchanged."
    )
    instructions: str | None = Field(
        default=None, description="Refused if set: the instructions live in the KV cache."
    )
    modality: Modality | None = Field(default=None, description="Refused if set.")
    retention: RetentionConfig | None = Field(
        default=None, description="Refused if set: the window's budget is reserved at open."
    )
    resumable: ResumableConfig | None = Field(default=None, description="Refused if set.")
    limits: ChunkLimits | None = Field(
        default=None, description="Refused if set: admission reserved the session for them."
    )


ClientEvent: TypeAlias = Annotated[
    SessionOpenEvent
    | FrameAppendEvent
    | ResponseCancelEvent
    | SessionCloseEvent
    | SessionResumeEvent
    | SessionUpdateEvent,
    Field(discriminator="type"),
]
"""Any event a client may send, discriminated on ``type``."""

CLIENT_EVENT_ADAPTER: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
"""Validator/serializer for :data:`ClientEvent`."""


# --------------------------------------------------------------------------- server payloads


class Limits(_Outbound):
    """What this server allows; sent in session.created and session.opened."""

    max_frame_bytes: int = Field(
        default=DEFAULT_MAX_FRAME_BYTES, ge=1, description="Largest decoded chunk payload, bytes."
    )
    max_event_bytes: int = Field(
        default=DEFAULT_MAX_EVENT_BYTES, ge=1, description="Largest JSON text message, bytes."
    )
    max_sessions: int = Field(default=1, ge=1, description="Sessions this server runs at once.")
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="Seconds without client events before the server closes."
    )
    max_tokens_cap: int = Field(
        default=4096, ge=1, description="Ceiling applied to sampling.max_tokens."
    )
    max_resume_grace_s: float = Field(
        default=0.0, ge=0, description="Cap on resumable.grace_s; 0: sessions are not resumable."
    )
    max_chunk_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens of one chunk's text (a text turn, or a frame's prompt, template "
        "included); over it: chunk_too_large. Frames add their image tokens; null: no cap.",
    )
    max_instructions_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens of session.open.instructions; null: no cap."
    )
    max_clip_frames: int | None = Field(
        default=None,
        ge=1,
        description="Most frames of one video clip a session may declare "
        "(session.open.limits.max_clip_frames; undeclared: single images); null: no clips.",
    )
    max_frame_pixels: int | None = Field(
        default=None,
        ge=1,
        description="Most pixels (width × height) of one image or clip frame the model gets; a "
        "larger one is resized down to it, its aspect kept; null: the model takes no frames.",
    )
    server_version: str = Field(description="Version of the vllm-realtime server.")
    model: str = Field(description="Name of the model this server serves.")
    protocol_version: str = Field(
        default=PROTOCOL_VERSION, description="Version of this wire protocol."
    )


class Usage(_Outbound):
    """Token counts of one reply."""

    prompt_tokens: int = Field(default=0, ge=0, description="Tokens prefilled for this chunk.")
    completion_tokens: int = Field(default=0, ge=0, description="Tokens generated for this reply.")


class Timing(_Outbound):
    """Latencies of one reply, in milliseconds; null where not measured."""

    queue_ms: float | None = Field(
        default=None, ge=0, description="From acceptance to the engine starting on it."
    )
    ttft_ms: float | None = Field(
        default=None, ge=0, description="From acceptance to the first generated token."
    )
    total_ms: float | None = Field(
        default=None, ge=0, description="From acceptance to response.done."
    )


class RetentionState(_Outbound):
    """What the session's context holds after a reply."""

    frames_retained: int = Field(default=0, ge=0, description="Chunks currently in the context.")
    frames_evicted: int = Field(default=0, ge=0, description="Chunks evicted so far.")
    tokens_retained: int = Field(default=0, ge=0, description="Tokens currently in the context.")
    kv_blocks_held: int = Field(default=0, ge=0, description="KV-cache blocks the session holds.")
    consolidations: int = Field(default=0, ge=0, description="Evictions (compactions) run so far.")


class ErrorDetail(_Outbound):
    """Body of an ``error`` event."""

    type: ErrorType = Field(description="Error class: who is at fault, broadly.")
    code: str = Field(description="Machine-readable error code (see docs/protocol.md).")
    message: str = Field(description="Human-readable explanation; never echoes large input.")
    event_id: str | None = Field(
        default=None, description="event_id of the client event this error answers, if known."
    )
    session_survives: bool = Field(
        description="True: the connection (and session, if open) stays usable."
    )
    param: str | None = Field(
        default=None,
        description="The offending field of the client event, as a dotted path "
        "(e.g. 'retention.window_chunks'); null: no single field is at fault.",
    )


# --------------------------------------------------------------------------- server events


class SessionCreatedEvent(_ServerEventBase):
    """``session.created``: greeting sent on connect, before any client event."""

    type: Literal["session.created"] = Field(default="session.created", description="Event type.")
    session_id: str = Field(description="Id of this connection's session.")
    limits: Limits = Field(description="What this server allows.")


class Reservation(_Outbound):
    """The KV capacity admission set aside for a session: its peak footprint."""

    kv_blocks: int = Field(ge=0, description="KV-cache blocks reserved for this session.")
    tokens: int = Field(ge=0, description="Peak tokens the session can hold.")
    block_size: int = Field(ge=1, description="Tokens per KV-cache block.")
    bounded: bool = Field(
        description="True: sized by the retention budget; false: the whole context."
    )


class SessionOpenedEvent(_ServerEventBase):
    """``session.opened``: answer to session.open; frames may be sent from now on."""

    type: Literal["session.opened"] = Field(default="session.opened", description="Event type.")
    session_id: str = Field(description="Id of this connection's session.")
    config: SessionConfig = Field(description="Effective settings (defaults filled, caps applied).")
    limits: Limits = Field(description="What this server allows.")
    resume_token: str | None = Field(
        default=None,
        description="Secret for session.resume (resumable sessions only); null otherwise.",
    )
    reservation: Reservation | None = Field(
        default=None, description="KV capacity reserved for this session by admission."
    )


class SessionUpdatedEvent(_ServerEventBase):
    """``session.updated``: answer to session.update; the settings every later chunk uses."""

    type: Literal["session.updated"] = Field(default="session.updated", description="Event type.")
    session_id: str = Field(description="Id of this connection's session.")
    config: SessionConfig = Field(description="Effective settings after the update.")


class InputAckEvent(_ServerEventBase):
    """``input.ack``: a frame.append was accepted; a response.done for it will follow."""

    type: Literal["input.ack"] = Field(default="input.ack", description="Event type.")
    frame_index: int = Field(ge=0, description="Server sequence number of the accepted chunk.")
    frame_id: str | None = Field(default=None, description="Client's label for the chunk.")
    bytes: int = Field(ge=0, description="Payload size: decoded media bytes or UTF-8 text bytes.")


class ResponseCreatedEvent(_ServerEventBase):
    """``response.created``: the engine started on the reply to a chunk."""

    type: Literal["response.created"] = Field(default="response.created", description="Event type.")
    frame_index: int = Field(ge=0, description="Chunk this reply answers.")
    frame_id: str | None = Field(default=None, description="Client's label for the chunk.")


class ResponseTextDeltaEvent(_ServerEventBase):
    """``response.text.delta``: more text of the reply in flight."""

    type: Literal["response.text.delta"] = Field(
        default="response.text.delta", description="Event type."
    )
    frame_index: int = Field(ge=0, description="Chunk this reply answers.")
    delta: str = Field(description="Text appended to the reply.")


class FrameResize(_Outbound):
    """A chunk's image (or its clip's frames) resized down to the session's frame cap."""

    from_size: tuple[int, int] = Field(description="Width and height the client sent, pixels.")
    to_size: tuple[int, int] = Field(description="Width and height the model got, pixels.")
    max_frame_pixels: int = Field(ge=1, description="The cap it was resized to fit.")


class ResponseDoneEvent(_ServerEventBase):
    """``response.done``: the reply to a chunk ended; sent exactly once per accepted chunk."""

    type: Literal["response.done"] = Field(default="response.done", description="Event type.")
    frame_index: int = Field(ge=0, description="Chunk this reply answers.")
    frame_id: str | None = Field(default=None, description="Client's label for the chunk.")
    status: ResponseStatus = Field(
        description="completed | cancelled | failed | incomplete (hit max_tokens or context) | "
        "ingested (reply: false; nothing generated)."
    )
    status_reason: str | None = Field(
        default=None, description="Why it was not completed, when it was not."
    )
    text: str = Field(default="", description="Full text of the reply (all deltas joined).")
    usage: Usage = Field(default_factory=Usage, description="Token counts of the reply.")
    timing: Timing = Field(default_factory=Timing, description="Latencies of the reply.")
    retention: RetentionState = Field(
        default_factory=RetentionState, description="Context state after the reply."
    )
    resized: FrameResize | None = Field(
        default=None,
        description="The chunk's frame was larger than limits.max_frame_pixels and was resized "
        "down to it; null: sent as is (or a text chunk).",
    )
    stored: bool | None = Field(
        default=None,
        description="Sessions kept in the session store: true when the session as of this "
        "reply is in the store (another replica can resume it from here); false when the "
        "store did not answer: the session goes on, resumable on this server only, until a "
        "later reply says true. Null: the session is not kept in a store.",
    )


class SessionResumedEvent(_ServerEventBase):
    """``session.resumed``: answer to session.resume; the session goes on on this connection."""

    type: Literal["session.resumed"] = Field(default="session.resumed", description="Event type.")
    session_id: str = Field(description="Id of the resumed session.")
    config: SessionConfig = Field(description="The session's effective settings.")
    limits: Limits = Field(description="What this server allows.")
    next_frame_index: int = Field(ge=0, description="frame_index the next accepted chunk gets.")
    in_flight_frame_index: int | None = Field(
        default=None,
        description="Chunk whose reply still runs (its response.done follows here); null: none.",
    )
    missed_response: ResponseDoneEvent | None = Field(
        default=None,
        description="The response.done that finished while no connection was attached, if any.",
    )
    resume_token: str = Field(description="New secret for the next session.resume (rotated).")
    rebuilt: bool = Field(
        default=False,
        description="True: this server rebuilt the session from the session store (its old "
        "server is gone or let it go); false: the server that held it took it back.",
    )
    reprefilled_tokens: int = Field(
        default=0,
        ge=0,
        description="Tokens of the retained context re-prefilled to rebuild it (0: not rebuilt).",
    )


class SessionClosedEvent(_ServerEventBase):
    """``session.closed``: last event of a connection; the server closes the socket after it."""

    type: Literal["session.closed"] = Field(default="session.closed", description="Event type.")
    session_id: str = Field(description="Id of the session that ended.")
    reason: CloseReason = Field(description="Why the session ended.")
    frames_total: int = Field(default=0, ge=0, description="Chunks accepted over the session.")


class ServerDrainingEvent(_ServerEventBase):
    """``server.draining``: the server is shutting down; finish the reply in flight and go.

    No new chunk is accepted. The session is closed (``server_shutdown``) as soon as it has no
    reply in flight, and at the latest after ``seconds_left``; reconnect (to this server once it
    is back, or to another replica) and open a new session.
    """

    type: Literal["server.draining"] = Field(default="server.draining", description="Event type.")
    seconds_left: float = Field(
        ge=0, description="Seconds until replies still running are cancelled and sessions closed."
    )
    handover: bool = Field(
        default=False,
        description="True: the session is kept in the session store; after session.closed, "
        "reconnect (through the router) and session.resume it with the last resume token: "
        "another replica rebuilds it. False: open a new session.",
    )


class ErrorEvent(_ServerEventBase):
    """``error``: something the client sent (or the server) failed; see error.session_survives."""

    type: Literal["error"] = Field(default="error", description="Event type.")
    error: ErrorDetail = Field(description="What went wrong.")


ServerEvent: TypeAlias = Annotated[
    SessionCreatedEvent
    | SessionOpenedEvent
    | InputAckEvent
    | ResponseCreatedEvent
    | ResponseTextDeltaEvent
    | ResponseDoneEvent
    | SessionClosedEvent
    | SessionResumedEvent
    | ServerDrainingEvent
    | SessionUpdatedEvent
    | ErrorEvent,
    Field(discriminator="type"),
]
"""Any event the server may send, discriminated on ``type``."""

SERVER_EVENT_ADAPTER: TypeAdapter[ServerEvent] = TypeAdapter(ServerEvent)
"""Validator/serializer for :data:`ServerEvent`."""


# --------------------------------------------------------------------------- HTTP: client secrets


class ClientSecretRequest(_Inbound):
    """Body of ``POST /v1/realtime/client_secrets`` (authenticated with the API key)."""

    expires_in_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Lifetime of the secret, seconds (capped by the server); null: its default.",
    )
    session: SessionConfig | None = Field(
        default=None,
        description="Bind the secret to this session config: session.open then opens exactly it.",
    )


class ClientSecret(_Outbound):
    """Answer of ``POST /v1/realtime/client_secrets``: a browser's short-lived credential."""

    client_secret: str = Field(
        description="Offer as the subprotocol vllm-realtime.auth.<client_secret>."
    )
    expires_at: float = Field(description="Unix time (seconds) after which no connection opens.")
    expires_in_s: float = Field(gt=0, description="Lifetime granted, seconds.")
    session: SessionConfig | None = Field(
        default=None, description="The session config the secret is bound to; null: none."
    )


CLIENT_EVENT_TYPES: dict[
    str,
    type[
        SessionOpenEvent
        | FrameAppendEvent
        | ResponseCancelEvent
        | SessionCloseEvent
        | SessionResumeEvent
        | SessionUpdateEvent
    ],
] = {
    "session.open": SessionOpenEvent,
    "frame.append": FrameAppendEvent,
    "response.cancel": ResponseCancelEvent,
    "session.close": SessionCloseEvent,
    "session.resume": SessionResumeEvent,
    "session.update": SessionUpdateEvent,
}
"""Client event models by their ``type``."""

SERVER_EVENT_TYPES: dict[str, type[_ServerEventBase]] = {
    "session.created": SessionCreatedEvent,
    "session.opened": SessionOpenedEvent,
    "input.ack": InputAckEvent,
    "response.created": ResponseCreatedEvent,
    "response.text.delta": ResponseTextDeltaEvent,
    "response.done": ResponseDoneEvent,
    "session.closed": SessionClosedEvent,
    "session.resumed": SessionResumedEvent,
    "server.draining": ServerDrainingEvent,
    "session.updated": SessionUpdatedEvent,
    "error": ErrorEvent,
}
"""Server event models by their ``type``."""
