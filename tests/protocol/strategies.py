"""Hypothesis strategies for the protocol tests (wire input, events, machine inputs)."""

from __future__ import annotations

import base64
from typing import Any

from hypothesis import strategies as st

from vllm_realtime_protocol.events import CLIENT_EVENT_TYPES, SERVER_EVENT_TYPES

JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 16
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
WEBP = b"RIFF\x00\x00\x00\x00WEBPVP8 " + b"\x00" * 8
MP4 = b"\x00\x00\x00\x18ftypisom" + b"\x00" * 8
WEBM = b"\x1a\x45\xdf\xa3" + b"\x00" * 16


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# --------------------------------------------------------------------------- raw JSON

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)

json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
"""Any JSON document (as Python values)."""

event_types = st.sampled_from(sorted(CLIENT_EVENT_TYPES) + sorted(SERVER_EVENT_TYPES))


@st.composite
def typed_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A dict with a known ``type`` and random values for (mostly) real field names."""
    event_type = draw(st.sampled_from(sorted(CLIENT_EVENT_TYPES)))
    model = CLIENT_EVENT_TYPES[event_type]
    names = sorted(set(model.model_fields) - {"type"})
    keys = st.sampled_from(names) | st.text(max_size=8)
    values = json_values | st.sampled_from([b64(JPEG), b64(MP4), "x", True, False, 0, 1, -1, 4097])
    obj = draw(st.dictionaries(keys, values, max_size=6))
    obj["type"] = event_type
    return obj


# --------------------------------------------------------------------------- machine inputs

# Each operation is a (name, argument) pair interpreted by the property test.
machine_ops = st.one_of(
    st.tuples(
        st.just("open"),
        st.fixed_dictionaries(
            {},
            optional={
                "modality": st.sampled_from(["video", "text"]),
                "frame_format": st.sampled_from(["jpeg", "png", "webp", "auto"]),
                "model": st.sampled_from(["test-model", "other-model"]),
            },
        ),
    ),
    st.tuples(
        st.just("append"),
        st.one_of(
            st.fixed_dictionaries({"image": st.sampled_from([JPEG, PNG, WEBP, MP4, b"junk"])}),
            st.fixed_dictionaries({"video": st.sampled_from([MP4, WEBM, JPEG, b"junk"])}),
            st.fixed_dictionaries({"text": st.text(min_size=1, max_size=10)}),
            st.fixed_dictionaries({"binary": st.just(True)}),
            st.just({"image_b64": "not base64!"}),
            st.just({"image_b64": b64(JPEG * 100)}),  # over the tiny frame limit
        ),
    ),
    st.tuples(st.just("binary"), st.sampled_from([JPEG, PNG, MP4, WEBM, b"junk", JPEG * 100])),
    st.tuples(st.just("cancel"), st.none()),
    st.tuples(st.just("close"), st.none()),
    st.tuples(st.just("open_refused"), st.none()),
    st.tuples(st.just("done"), st.sampled_from(["completed", "cancelled", "failed", "incomplete"])),
    st.tuples(
        st.just("server_close"),
        st.sampled_from(["engine_error", "disconnect", "idle_timeout", "server_shutdown", "error"]),
    ),
)
"""One input to SessionProtocol, valid or not."""
