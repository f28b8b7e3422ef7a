"""Adversarial inputs and the oracle they are judged by; pure (no sockets, no engine).

Shared by the hypothesis tests (`test_fuzz.py`, a few hundred cases in CI), the socket fuzz
against the real server, and `tests/reliability/fuzz_long.py` (≥100,000 cases). Every generator takes a
`random.Random`, so a failing case is reproduced from its seed.

The oracle: whatever a client sends, the server side answers with a documented protocol error
(a class of `protocol.ERROR_CLASSES`, never `internal_error`) or does what the protocol says; no
other exception escapes the codec, the state machine or the media decoders.
"""

from __future__ import annotations

import base64
import io
import json
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from realtime.media import decode_clip, decode_image
from vllm_realtime_protocol import (
    ERROR_CLASSES,
    AwaitBinary,
    CancelResponse,
    CloseSession,
    Limits,
    OpenSession,
    RealtimeError,
    SessionProtocol,
    State,
    SubmitFrame,
    encode_server_event,
    error_event,
    parse_client_event,
    parse_server_event,
)
from vllm_realtime_protocol.constants import MAX_ERROR_MESSAGE_CHARS

DOCUMENTED_CODES = frozenset(cls.code for cls in ERROR_CLASSES)
# What the codec alone may answer.
PARSE_CODES = frozenset({"frame_too_large", "invalid_json", "unknown_event_type", "invalid_event"})
# Codes that are never the client's doing; a client input must not provoke them.
SERVER_FAULT_CODES = frozenset({"internal_error", "engine_error"})

# Small limits for the pure fuzz, so that size limits are reached cheaply.
FUZZ_LIMITS = Limits(
    max_frame_bytes=64 << 10,
    max_event_bytes=256 << 10,
    max_sessions=4,
    max_tokens_cap=64,
    server_version="fuzz",
    model="fuzz-model",
)

MARKER = "Zq7Xw"  # repeated to build huge strings; must never come back in an error message


class OracleViolation(AssertionError):
    """An input got an answer the protocol does not document."""


# --------------------------------------------------------------------------- the oracle


def check_error(exc: BaseException, *, allowed: frozenset[str] | None = None) -> str:
    """`exc` must be a documented protocol error (optionally one of `allowed`); its code."""
    if not isinstance(exc, RealtimeError):
        raise OracleViolation(f"undocumented exception {type(exc).__name__}: {exc!r}") from exc
    if type(exc) not in ERROR_CLASSES:
        raise OracleViolation(f"{type(exc).__name__} is not one of protocol.ERROR_CLASSES")
    if exc.code in SERVER_FAULT_CODES:
        raise OracleViolation(f"client input provoked {exc.code}: {exc.message}")
    if allowed is not None and exc.code not in allowed:
        raise OracleViolation(f"{exc.code} where only {sorted(allowed)} may occur: {exc.message}")
    if len(exc.message) > MAX_ERROR_MESSAGE_CHARS:
        raise OracleViolation(f"error message of {len(exc.message)} characters")
    if MARKER * 20 in exc.message:  # a quoted prefix (≤ 80 characters) is fine
        raise OracleViolation("an error message echoes large input")
    # It goes on the wire: it must encode, and decode back to the same code.
    wire = encode_server_event(error_event(exc))
    back = parse_server_event(wire)
    if back.type != "error" or back.error.code != exc.code:  # type: ignore[union-attr]
        raise OracleViolation("error event does not round-trip")
    return exc.code


def check_parse(message: str | bytes, limits: Limits = FUZZ_LIMITS) -> str | None:
    """Parse one wire message; None if it is an event, else the documented code it got."""
    try:
        parse_client_event(message, max_bytes=limits.max_event_bytes)
    except Exception as exc:
        return check_error(exc, allowed=PARSE_CODES)
    return None


def check_media(kind: str, data: bytes) -> str | None:
    """Decode a payload as the server does before the engine sees it; None if it decoded."""
    try:
        if kind == "video":
            clip, meta = decode_clip(data, max_frames=4)
            if clip.ndim != 4 or clip.shape[0] % 2 or clip.shape[-1] != 3:
                raise OracleViolation(f"clip decoded to shape {clip.shape}")
            if len(meta["frames_indices"]) != clip.shape[0] or meta["fps"] <= 0:
                raise OracleViolation(f"clip metadata {meta} does not describe its frames")
        else:
            img = decode_image(data)
            if img.mode != "RGB" or img.width < 1 or img.height < 1:
                raise OracleViolation(f"image decoded to {img.mode} {img.size}")
    except OracleViolation:
        raise
    except Exception as exc:
        return check_error(exc, allowed=frozenset({"undecodable_frame"}))
    return None


# --------------------------------------------------------------------------- media seeds


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_with_header(width: int, height: int, payload: bytes = b"") -> bytes:
    """A PNG whose IHDR claims `width`×`height` (a decompression-bomb shape), CRCs valid."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(payload or b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def _image(fmt: str, size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    img = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _clip(fmt: str, codec: str, frames: int, size: int = 32) -> bytes:
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=4)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(
                np.full((size, size, 3), i * 40 % 255, np.uint8), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@lru_cache(maxsize=1)
def media_seeds() -> dict[str, tuple[str, bytes]]:
    """Valid (and some valid-but-odd) payloads to mutate: name → (kind, bytes)."""
    seeds: dict[str, tuple[str, bytes]] = {
        "jpeg": ("image", _image("JPEG", (48, 40))),
        "jpeg_gray": ("image", _image("JPEG", (32, 32), "L", 1)),
        "jpeg_cmyk": ("image", _image("JPEG", (32, 32), "CMYK", 2)),
        "png": ("image", _image("PNG", (40, 48), seed=3)),
        "png_rgba": ("image", _image("PNG", (16, 16), "RGBA", 4)),
        "png_palette": ("image", _image("PNG", (16, 16), "P", 5)),
        "png_16bit": ("image", _image("PNG", (16, 16), "I;16", 6)),
        "webp": ("image", _image("WEBP", (32, 32), seed=7)),
        "jpeg_1x1": ("image", _image("JPEG", (1, 1), seed=8)),
        "jpeg_thin": ("image", _image("JPEG", (300, 1), seed=9)),  # aspect 300:1
        "png_bomb": ("image", png_with_header(60000, 60000)),
        "png_huge_ok": ("image", png_with_header(4000, 4000)),
        "mp4": ("video", _clip("mp4", "mpeg4", 3)),
        "webm": ("video", _clip("webm", "libvpx", 2)),
    }
    return seeds


# --------------------------------------------------------------------------- mutations


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """One random structural damage: truncate, flip, insert, delete, splice, header patch."""
    if not data:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 32)))
    n = len(data)
    op = rng.randrange(9)
    if op == 0:  # truncate
        return data[: rng.randrange(n)]
    if op == 1:  # flip a few bits
        buf = bytearray(data)
        for _ in range(rng.randrange(1, 9)):
            buf[rng.randrange(n)] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if op == 2:  # insert junk
        at = rng.randrange(n + 1)
        return data[:at] + rng.randbytes(rng.randrange(1, 64)) + data[at:]
    if op == 3:  # delete a span
        at = rng.randrange(n)
        return data[:at] + data[at + rng.randrange(1, 64) :]
    if op == 4:  # duplicate a span
        at = rng.randrange(n)
        span = data[at : at + rng.randrange(1, 256)]
        return data[:at] + span * rng.randrange(2, 8) + data[at:]
    if op == 5:  # keep the magic, replace the rest
        return data[:12] + rng.randbytes(rng.randrange(0, 512))
    if op == 6:  # overwrite 4 bytes near the start with an extreme integer (dimensions, lengths)
        at = rng.randrange(min(n, 64))
        value = rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 65535, 4097, 16384])
        return data[:at] + struct.pack(">I", value) + data[at + 4 :]
    if op == 7:  # splice two seeds
        other = rng.choice(list(media_seeds().values()))[1]
        cut = rng.randrange(n)
        return data[:cut] + other[rng.randrange(len(other)) :]
    return data + rng.randbytes(rng.randrange(1, 128))  # trailing junk


def gen_media(rng: random.Random) -> tuple[str, str, bytes]:
    """(seed name, kind, payload): a seed, often damaged once or several times."""
    name, (kind, data) = rng.choice(sorted(media_seeds().items()))
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        data = mutate_bytes(rng, data)
    return name, kind, data


# --------------------------------------------------------------------------- wire messages


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(10 if depth < 3 else 7)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, 1, -1, 4096, 4097, 2**31, -(2**63), 2**70])
    if pick == 3:
        return rng.choice([0.0, 0.5, -1.5, 1e300, 2.0000001, 64.0])
    if pick in (4, 5, 6):
        return _text(rng, rng.randrange(0, 24))
    if pick in (7, 8):
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_text(rng, rng.randrange(1, 8)): _json_value(rng, depth + 1) for _ in range(3)}


_ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyz",
    "0123456789 .,-+eE",
    '{}[]":,\\/\x00\x1f\x7f',
    "éß中文日本語🙂\u200b\u202e\ufeff",
]


def _text(rng: random.Random, n: int) -> str:
    alphabet = rng.choice(_ALPHABETS)
    return "".join(rng.choice(alphabet) for _ in range(n))


def valid_event(rng: random.Random, media: tuple[str, str, bytes] | None = None) -> dict[str, Any]:
    """A well-formed client event (its payload may still be bad media)."""
    kind = rng.randrange(8)
    ev: dict[str, Any]
    if kind == 0:
        ev = {"type": "session.open", "sampling": {"max_tokens": rng.choice([1, 2, 4])}}
        if rng.random() < 0.3:
            ev["modality"] = "text"
        if rng.random() < 0.3:
            ev["frame_format"] = rng.choice(["jpeg", "png", "webp", "auto"])
        if rng.random() < 0.2:
            ev["retention"] = {"window_chunks": None, "window_tokens": rng.randrange(1, 512)}
    elif kind in (1, 2, 3):
        _, mkind, data = media or gen_media(rng)
        field_name = "video" if mkind == "video" else "image"
        encoded = base64.b64encode(data).decode()
        if rng.random() < 0.1:
            encoded = "data:image/jpeg;base64," + encoded
        ev = {"type": "frame.append", field_name: encoded}
    elif kind == 4:
        ev = {"type": "frame.append", "text": _text(rng, rng.randrange(1, 40)) or "x"}
    elif kind == 5:
        ev = {"type": "frame.append", "binary": True}
    elif kind == 6:
        ev = {"type": "response.cancel"}
    else:
        ev = {"type": "session.close"}
    if rng.random() < 0.5:
        ev["event_id"] = f"c-{rng.randrange(10**6)}"
    if ev["type"] == "frame.append":
        if rng.random() < 0.3:
            ev["frame_id"] = f"f-{rng.randrange(10**6)}"
        if rng.random() < 0.2:
            ev["prompt"] = _text(rng, rng.randrange(0, 20))
        if rng.random() < 0.1:
            ev["timestamp"] = rng.choice([0.0, 12.5, -3.0, 1e12])
    return ev


def _huge(rng: random.Random, max_bytes: int) -> str:
    return MARKER * max(1, rng.randrange(max_bytes // len(MARKER) + 1))


MESSAGE_CATEGORIES = (
    *("bytes", "text", "json", "truncated", "wrong_type", "unknown_field", "huge", "nested"),
    *("numbers", "valid", "valid", "valid"),
)


def gen_message(
    rng: random.Random, *, max_huge: int = 300 << 10, socket_safe: bool = False
) -> tuple[str, str | bytes]:
    """(category, message) for one WebSocket text message, most of them broken on purpose.

    `socket_safe`: only what a WebSocket text frame can carry (valid UTF-8 `str`)."""
    cat = rng.choice(MESSAGE_CATEGORIES)
    if cat == "bytes":
        raw = rng.randbytes(rng.randrange(0, 96))
        if socket_safe:
            return cat, raw.decode("utf-8", "replace")
        return cat, raw
    if cat == "text":
        return cat, _text(rng, rng.randrange(0, 64))
    if cat == "json":
        return cat, json.dumps(_json_value(rng))
    ev = valid_event(rng)
    if cat == "truncated":
        text = json.dumps(ev)
        return cat, text[: rng.randrange(len(text))]
    if cat == "wrong_type":
        keys = [k for k in ev if k != "type"] or ["event_id"]
        key = rng.choice([*keys, "type", "sampling", "retention"])
        ev[key] = _json_value(rng)
        if key == "sampling" and rng.random() < 0.5:
            ev[key] = {"max_tokens": rng.choice(["64", 64.0, 0, 5000, -1, True, None])}
        return cat, json.dumps(ev)
    if cat == "unknown_field":
        ev[rng.choice(["session_id", "bogus", "Type", "", "image\u0000"])] = _json_value(rng)
        return cat, json.dumps(ev)
    if cat == "huge":
        key = rng.choice(
            ["event_id", "frame_id", "prompt", "text", "instructions", "image", "type"]
        )
        ev[key] = _huge(rng, max_huge)
        return cat, json.dumps(ev)
    if cat == "nested":
        depth = rng.choice([50, 1000, 100_000])
        return cat, "[" * depth + "]" * rng.choice([0, depth])
    if cat == "numbers":
        number = rng.choice(["1e999", "-1e999", "1" * 5000, "NaN", "Infinity", "-0", "0x10"])
        return cat, '{"type": "frame.append", "text": "x", "timestamp": ' + number + "}"
    return cat, json.dumps(ev)


# --------------------------------------------------------------------------- a session, modelled


@dataclass
class Reply:
    """What the server does with one client message, as the protocol predicts it."""

    kind: str  # "error" | "opened" | "await_binary" | "accepted" | "cancel" | "closed"
    code: str | None = None
    survives: bool = True
    frame_index: int | None = None
    media_error: str | None = None  # an accepted chunk that fails at decode: its code


@dataclass
class SessionModel:
    """A connection's server-side handling without I/O: the codec, the state machine, and the
    decode the server runs before the engine (`render_chunk`). The socket fuzz runs it next to
    the real server to predict each answer; the pure fuzz runs it alone under the oracle."""

    limits: Limits = field(default_factory=lambda: FUZZ_LIMITS)
    decode: bool = True
    proto: SessionProtocol = field(init=False)

    def __post_init__(self) -> None:
        self.proto = SessionProtocol(self.limits, session_id="sess_model")

    def feed(self, message: str | bytes, *, binary: bool = False) -> Reply:
        before = (self.proto.state, self.proto.frames_total, self.proto.in_flight)
        try:
            if binary:
                assert isinstance(message, bytes)
                action: Any = self.proto.receive_binary(message)
            else:
                action = self.proto.receive_client_event(
                    parse_client_event(message, max_bytes=self.limits.max_event_bytes)
                )
        except Exception as exc:
            refused = exc
        else:
            return self._action(action)
        code = check_error(refused)
        after = (self.proto.state, self.proto.frames_total, self.proto.in_flight)
        consumed = binary and before[0] is State.AWAITING_BINARY
        if after != before and not consumed:
            raise OracleViolation(f"refusal {code} changed the state {before} → {after}")
        if consumed and self.proto.state is not State.IDLE:
            raise OracleViolation("a refused awaited binary payload did not return to IDLE")
        assert isinstance(refused, RealtimeError)
        if not refused.session_survives:
            self.proto.server_close("error")
        return Reply("error", code=code, survives=refused.session_survives)

    def _action(self, action: Any) -> Reply:
        if isinstance(action, OpenSession):
            return Reply("opened")
        if isinstance(action, AwaitBinary):
            return Reply("await_binary")
        if isinstance(action, CancelResponse):
            return Reply("cancel", frame_index=action.frame_index)
        if isinstance(action, CloseSession):
            return Reply("closed")
        assert isinstance(action, SubmitFrame)
        frame = action.frame
        if frame.frame_index != self.proto.frames_total - 1:
            raise OracleViolation("frame_index is not the next in sequence")
        media_error = None
        if self.decode and frame.kind in ("image", "video"):
            media_error = check_media(frame.kind, frame.data)
        return Reply("accepted", frame_index=frame.frame_index, media_error=media_error)

    def finish(self, status: str = "completed") -> None:
        self.proto.response_finished(status)  # type: ignore[arg-type]


def run_session_case(rng: random.Random, n_ops: int = 12) -> list[str]:
    """One connection's worth of random inputs through `SessionModel`; the categories seen."""
    model = SessionModel()
    seen: list[str] = []
    for _ in range(n_ops):
        if model.proto.state is State.CLOSED and rng.random() < 0.7:
            break
        roll = rng.random()
        if roll < 0.15:
            _, _, data = gen_media(rng)
            if rng.random() < 0.2:
                data = rng.randbytes(rng.randrange(0, 64))
            seen.append("binary")
            reply = model.feed(data, binary=True)
        elif roll < 0.25 and model.proto.state is State.AWAITING_RESPONSE:
            seen.append("done")
            model.finish(rng.choice(["completed", "cancelled", "failed", "incomplete"]))
            continue
        elif roll < 0.3:
            seen.append("server_close")
            reason = rng.choice(["engine_error", "disconnect", "idle_timeout", "server_shutdown"])
            close = model.proto.server_close(reason)  # type: ignore[arg-type]
            if close is not None and close.in_flight is not None:
                model.finish("cancelled")  # the drain
            continue
        else:
            cat, message = gen_message(rng, max_huge=FUZZ_LIMITS.max_event_bytes + 1024)
            seen.append(cat)
            reply = model.feed(message)
        if reply.kind == "accepted" and rng.random() < 0.7:
            model.finish("failed" if reply.media_error else "completed")
    return seen


CaseRunner = Callable[[random.Random], str]


def case_parse(rng: random.Random) -> str:
    cat, message = gen_message(rng, max_huge=FUZZ_LIMITS.max_event_bytes + 1024)
    check_parse(message)
    return f"parse:{cat}"


def case_media(rng: random.Random) -> str:
    name, kind, data = gen_media(rng)
    check_media(kind, data)
    return f"media:{name}"


def case_session(rng: random.Random) -> str:
    run_session_case(rng, n_ops=rng.randrange(1, 16))
    return "session"


CASES: dict[str, CaseRunner] = {"parse": case_parse, "media": case_media, "session": case_session}
