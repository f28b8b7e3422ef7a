"""Fuzz (hypothesis, fast): wire input, media payloads and input orders get documented errors only.

The oracle is `fuzzcore.check_error`: a class of `protocol.ERROR_CLASSES`, never
`internal_error`/`engine_error`, a bounded message that does not echo large input, and an
`error` event that round-trips. `tests/reliability/fuzz_long.py` runs the same generators ≥100,000 times.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from realtime.media import MAX_IMAGE_PIXELS, decode_clip
from tests.reliability import fuzzcore as fc
from vllm_realtime_protocol import SessionConfig, State, UndecodableFrame
from vllm_realtime_protocol.events import CLIENT_EVENT_TYPES

CI = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LIMIT = fc.FUZZ_LIMITS.max_event_bytes

seeds = st.integers(0, 2**32 - 1)


@CI
@given(st.binary(max_size=512) | st.text(max_size=256))
def test_arbitrary_messages(message: bytes | str) -> None:
    fc.check_parse(message)


@CI
@given(seeds, st.floats(0, 1))
def test_truncated_events(seed: int, at: float) -> None:
    text = json.dumps(fc.valid_event(random.Random(seed)))
    cut = text[: int(len(text) * at)]
    code = fc.check_parse(cut)
    if cut != text:
        assert code in ("invalid_json", "unknown_event_type", "invalid_event", None)


json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)


@CI
@given(st.sampled_from(sorted(CLIENT_EVENT_TYPES)), st.data())
def test_wrong_types_in_real_fields(event_type: str, data: st.DataObject) -> None:
    fields = sorted(set(CLIENT_EVENT_TYPES[event_type].model_fields) - {"type"})
    obj = {name: data.draw(json_values) for name in data.draw(st.sets(st.sampled_from(fields)))}
    obj["type"] = event_type
    fc.check_parse(json.dumps(obj))


@CI
@given(
    st.sampled_from(["event_id", "frame_id", "prompt", "text", "instructions", "image", "bogus"]),
    st.integers(LIMIT - 64, LIMIT + 64) | st.integers(1, 4096),
    st.sampled_from(["frame.append", "session.open"]),
)
def test_huge_strings(field: str, size: int, event_type: str) -> None:
    head = json.dumps({"type": event_type, field: ""})
    value = (fc.MARKER * (size // len(fc.MARKER) + 1))[: max(0, size - len(head))]
    message = json.dumps({"type": event_type, field: value})
    code = fc.check_parse(message)
    if len(message.encode()) > LIMIT:
        assert code == "frame_too_large"


@CI
@given(st.sampled_from(sorted(fc.media_seeds())), st.lists(seeds, max_size=3))
def test_corrupt_media(name: str, mutations: list[int]) -> None:
    kind, data = fc.media_seeds()[name]
    for seed in mutations:
        data = fc.mutate_bytes(random.Random(seed), data)
    fc.check_media(kind, data)


@CI
@given(st.integers(1, 70000), st.integers(1, 70000))
def test_oversized_image_headers(width: int, height: int) -> None:
    code = fc.check_media("image", fc.png_with_header(width, height))
    if width * height > MAX_IMAGE_PIXELS:
        assert code == "undecodable_frame"


def test_clip_pixel_budget_refuses_large_clips() -> None:
    """Fix in realtime/media.py: a clip's frames together are capped, not only each one."""
    kind, clip = fc.media_seeds()["mp4"]  # 3 frames of 32×32
    frames, meta = decode_clip(clip)
    assert frames.shape[0] == 4  # padded to an even count
    # What Qwen2.5-VL / Qwen3-VL processors need: the clip's rate, its frames, no resampling.
    assert meta["total_num_frames"] == 4 and meta["frames_indices"] == [0, 1, 2, 2]
    assert meta["do_sample_frames"] is False and meta["fps"] > 0
    with pytest.raises(UndecodableFrame):
        decode_clip(clip, max_pixels=2 * 32 * 32)
    assert fc.check_media(kind, clip) is None


binary_orders = st.lists(
    st.sampled_from(
        ["open", "open_text", "announce", "binary", "image", "cancel", "done", "close"]
    ),
    max_size=12,
)


@CI
@given(binary_orders)
def test_binary_messages_out_of_order(order: list[str]) -> None:
    """Binary payloads anywhere in the sequence: refused exactly as docs/protocol.md says."""
    jpeg = fc.media_seeds()["jpeg"][1]
    model = fc.SessionModel()
    for step in order:
        state = model.proto.state
        if step == "done":
            if state is State.AWAITING_RESPONSE:
                model.finish()
            continue
        if step == "binary":
            reply = model.feed(jpeg, binary=True)
            if state is State.AWAITING_BINARY:
                assert reply.kind == "accepted" and model.proto.state is State.AWAITING_RESPONSE
            elif state is State.CLOSED:
                assert reply.code == "session_closed"
            else:
                assert reply.code == "binary_unexpected" and model.proto.state is state
            continue
        message = {
            "open": {"type": "session.open"},
            "open_text": {"type": "session.open", "modality": "text"},
            "announce": {"type": "frame.append", "binary": True},
            "image": {"type": "frame.append", "image": base64.b64encode(jpeg).decode()},
            "cancel": {"type": "response.cancel"},
            "close": {"type": "session.close"},
        }[step]
        reply = model.feed(json.dumps(message))
        if step == "announce" and state is State.IDLE:
            is_video = (model.proto.config or SessionConfig()).modality == "video"
            assert reply.kind == ("await_binary" if is_video else "error")
        if state is State.AWAITING_BINARY and step in ("announce", "image"):
            assert reply.code == "chunk_in_flight"


@CI
@given(seeds)
def test_random_sessions(seed: int) -> None:
    fc.run_session_case(random.Random(seed), n_ops=16)


@CI
@given(seeds)
def test_random_messages(seed: int) -> None:
    fc.case_parse(random.Random(seed))
