"""Protocol-wide constants shared by the server and its clients.

Nothing here depends on the rest of the package, so every module (and every
client) can import it without pulling in pydantic models.
"""

from __future__ import annotations

from typing import Final

PROTOCOL_VERSION: Final = "2026-12-01"
"""Version of the wire protocol described in docs/protocol.md (a date, like OpenAI's)."""

SUBPROTOCOL: Final = "vllm-realtime"
"""WebSocket subprotocol the server selects; clients must offer it."""

AUTH_SUBPROTOCOL_PREFIX: Final = "vllm-realtime.auth."
"""Prefix of the subprotocol that carries an API key, for clients that cannot set headers."""

DEFAULT_MAX_EVENT_BYTES: Final = 16 * 1024 * 1024
"""Default cap on one JSON text message (base64 frames included), in UTF-8 bytes."""

DEFAULT_MAX_FRAME_BYTES: Final = 8 * 1024 * 1024
"""Default cap on one decoded frame payload (image, clip, binary message or text turn)."""

MAX_EVENT_ID_CHARS: Final = 256
"""Longest client `event_id` accepted (and therefore ever echoed back in an `error`)."""

MAX_ERROR_MESSAGE_CHARS: Final = 500
MAX_PARAM_CHARS: Final = 128
"""Longest ``error.param`` (a field path; loc parts are cut before that)."""
"""Longest `error.message` the server sends; longer messages are truncated with an ellipsis."""
