"""Python client for vllm-realtime: stream frames (or text turns) into one long-lived session.

Async first::

    from vllm_realtime_client import connect

    async with connect("ws://127.0.0.1:8000/v1/realtime", api_key="KEY") as session:
        await session.open(instructions="Describe each frame.", retention={"window_chunks": 8})
        done = await session.append_frame(jpeg_bytes, prompt="What changed?")
        print(done.text, done.timing.total_ms, done.retention.kv_blocks_held)

A blocking wrapper lives in :mod:`vllm_realtime_client.sync`.  Events are the protocol's own
pydantic models (:mod:`vllm_realtime_protocol.events`) and errors its own classes (:mod:`vllm_realtime_protocol.errors`),
re-exported here; see docs/protocol.md for the wire protocol.
"""

from __future__ import annotations

from vllm_realtime_client.client_secrets import mint_client_secret, mint_client_secret_sync
from vllm_realtime_client.errors import (
    AuthError,
    CapacityError,
    CapacityExceeded,
    ChunkInFlight,
    ClientError,
    ConnectError,
    ConnectionLost,
    ContextExceeded,
    EngineError,
    FrameTooLarge,
    IdleTimeout,
    InvalidEvent,
    InvalidRequestError,
    RealtimeError,
    ResponseTimeout,
    ServerError,
    SessionClosed,
    SessionNotOpen,
    Unauthorized,
    UndecodableFrame,
    VllmRealtimeError,
)
from vllm_realtime_client.session import (
    AuthMethod,
    Connector,
    RealtimeSession,
    ResponseStream,
    connect,
)
from vllm_realtime_protocol.constants import PROTOCOL_VERSION
from vllm_realtime_protocol.events import (
    ErrorEvent,
    InputAckEvent,
    Limits,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseTextDeltaEvent,
    RetentionConfig,
    RetentionState,
    SamplingConfig,
    ServerEvent,
    SessionClosedEvent,
    SessionConfig,
    SessionCreatedEvent,
    SessionOpenedEvent,
    Timing,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "AuthError",
    "AuthMethod",
    "CapacityError",
    "CapacityExceeded",
    "ChunkInFlight",
    "ClientError",
    "ConnectError",
    "ConnectionLost",
    "Connector",
    "ContextExceeded",
    "EngineError",
    "ErrorEvent",
    "FrameTooLarge",
    "IdleTimeout",
    "InputAckEvent",
    "InvalidEvent",
    "InvalidRequestError",
    "Limits",
    "RealtimeError",
    "RealtimeSession",
    "ResponseCreatedEvent",
    "ResponseDoneEvent",
    "ResponseStream",
    "ResponseTextDeltaEvent",
    "ResponseTimeout",
    "RetentionConfig",
    "RetentionState",
    "SamplingConfig",
    "ServerError",
    "ServerEvent",
    "SessionClosed",
    "SessionClosedEvent",
    "SessionConfig",
    "SessionCreatedEvent",
    "SessionNotOpen",
    "SessionOpenedEvent",
    "Timing",
    "Unauthorized",
    "UndecodableFrame",
    "Usage",
    "VllmRealtimeError",
    "__version__",
    "connect",
    "mint_client_secret",
    "mint_client_secret_sync",
]
