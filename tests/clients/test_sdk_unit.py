"""The Python SDK against a protocol-exact fake server: routing, typed errors, timeouts, shutdown."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from vllm_realtime_client import (
    CapacityExceeded,
    ChunkInFlight,
    ConnectionLost,
    ContextExceeded,
    FrameTooLarge,
    InvalidEvent,
    InvalidRequestError,
    ResponseDoneEvent,
    ResponseTimeout,
    ServerError,
    SessionClosed,
    SessionNotOpen,
    Unauthorized,
    UndecodableFrame,
    connect,
)
from vllm_realtime_client import errors as sdk_errors
from vllm_realtime_client import sync as sdk_sync
from vllm_realtime_client.errors import SessionAlreadyOpen

from tests.clients.fake_server import fake_server
from vllm_realtime_protocol import ERROR_CLASSES, ErrorDetail

FAKE_JPEG = b"\xff\xd8\xff\xe0" + b"x" * 96 + b"\xff\xd9"


def frames_sent(received: list[object]) -> list[dict[str, object]]:
    return [
        e
        for e in (json.loads(m) for m in received if isinstance(m, str))
        if e["type"] == "frame.append"
    ]


async def test_open_append_binary_and_close() -> None:
    async with fake_server() as srv:
        async with connect(srv.url) as session:
            assert session.session_id.startswith("sess_")
            opened = await session.open(instructions="hi", sampling={"max_tokens": 8})
            assert opened.config.sampling.max_tokens == 8 and session.config == opened.config
            done = await session.append_frame(FAKE_JPEG, prompt="what?", frame_id="f0")
            assert isinstance(done, ResponseDoneEvent)
            assert (done.frame_index, done.frame_id, done.status) == (0, "f0", "completed")
            assert done.text == f"echo:image:{len(FAKE_JPEG)}"
            assert not session.busy
        assert session.closed is not None and session.closed.reason == "client_closed"
        assert session.closed.frames_total == 1
        # Announcement, then the raw bytes as the very next message.
        i = next(n for n, m in enumerate(srv.received) if isinstance(m, bytes))
        announce = json.loads(srv.received[i - 1])
        assert announce["binary"] is True and announce["image"] is None
        assert announce["prompt"] == "what?" and announce["event_id"].startswith("sdk-")
        assert srv.received[i] == FAKE_JPEG
        with pytest.raises(SessionClosed):
            await session.append_frame(FAKE_JPEG)
        assert await session.close() is session.closed  # twice is harmless


async def test_base64_mode_and_stream_frame() -> None:
    async with fake_server() as srv, connect(srv.url, config={"modality": "video"}) as session:
        assert session.opened is not None  # opened by connect(config=...)
        await session.append_frame(FAKE_JPEG, binary=False)
        assert frames_sent(srv.received)[-1]["image"] == base64.b64encode(FAKE_JPEG).decode()
        stream = session.stream_frame(FAKE_JPEG, frame_id="s")
        assert stream.done is None and not session.busy  # nothing sent until iterated
        deltas = [d.delta async for d in stream]
        assert deltas == ["echo:", "image:", str(len(FAKE_JPEG))]
        assert stream.ack is not None and stream.ack.frame_index == 1
        assert stream.done is not None and stream.done.text == "".join(deltas) == stream.text
        assert await stream.result() is stream.done


async def test_text_turns() -> None:
    async with fake_server() as srv, connect(srv.url, config={"modality": "text"}) as session:
        done = await session.append_text("hello there", prompt="p")
        assert done.text == "echo:text:11"
        parts = [d.delta async for d in session.stream_text("x")]
        assert "".join(parts) == "echo:text:1"


async def test_capacity_exceeded_is_typed_and_open_can_be_retried() -> None:
    async with fake_server(refuse_opens=1) as srv, connect(srv.url) as session:
        with pytest.raises(CapacityExceeded) as info:
            await session.open()
        assert info.value.session_survives and info.value.event_id == "sdk-1"
        assert await session.open()
        with pytest.raises(SessionAlreadyOpen):
            await session.open()


async def test_api_key_header_subprotocol_and_refusal() -> None:
    async with fake_server(api_key="k") as srv:
        async with connect(srv.url, api_key="k") as session:
            await session.open()
        async with connect(srv.url, api_key="k", auth="subprotocol") as session:
            await session.open()
        for key in ("wrong", None):
            with pytest.raises(Unauthorized, match="HTTP 403"):
                await connect(srv.url, api_key=key)


async def test_local_checks_need_no_round_trip() -> None:
    async with fake_server() as srv, connect(srv.url) as session:
        with pytest.raises(SessionNotOpen):
            await session.append_frame(FAKE_JPEG)
        with pytest.raises(InvalidEvent, match="max_tokens"):
            await session.open(sampling={"max_tokens": 0})
        await session.open()
        with pytest.raises(UndecodableFrame):
            session.stream_frame(b"GIF89a not accepted")
        with pytest.raises(FrameTooLarge):  # the fake announces max_frame_bytes=4096
            session.stream_frame(b"\xff\xd8\xff" + b"0" * 5000)
        with pytest.raises(InvalidEvent, match="frame_id"):
            session.stream_frame(FAKE_JPEG, frame_id="x" * 300)
        assert frames_sent(srv.received) == []


async def test_a_second_append_in_flight_is_refused_locally_as_in_js() -> None:
    """One rule for both SDKs (docs/protocol.md, "One chunk in flight"): no hidden queue."""
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        results = await asyncio.gather(
            *(session.append_frame(FAKE_JPEG) for _ in range(4)), return_exceptions=True
        )
        done = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        assert [d.frame_index for d in done] == [0]
        assert [type(r) for r in refused] == [ChunkInFlight] * 3
        assert len(frames_sent(srv.received)) == 1  # the server was never asked
        assert session.errors == type(session.errors)()  # no chunk_in_flight came back


async def test_offer_frame_drops_while_busy_and_events_iterate_in_order() -> None:
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        seen: list[str] = []

        async def watch() -> None:
            async for event in session:
                seen.append(event.type)
                if event.type == "session.closed":
                    return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        made: list[int] = []

        def capture() -> bytes:
            made.append(1)
            return FAKE_JPEG

        first = asyncio.create_task(session.offer_frame(capture, prompt="slow"))
        await asyncio.sleep(0.05)
        assert session.busy
        assert await session.offer_frame(capture) is None  # dropped, never captured
        assert (session.dropped, len(made)) == (1, 1)
        done = await first
        assert done is not None and done.frame_index == 0
        again = await session.offer_frame(FAKE_JPEG)
        assert again is not None and again.frame_index == 1
        await session.close()
        await asyncio.wait_for(watcher, 5)
    assert seen.count("response.done") == 2 and seen[-1] == "session.closed"
    assert seen.index("input.ack") < seen.index("response.done")


async def test_failed_reply_is_returned_and_its_trailing_error_kept() -> None:
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        done = await session.append_frame(FAKE_JPEG, prompt="late-error")
        assert done.status == "failed"
        again = await session.append_frame(FAKE_JPEG)  # the session survived
        assert again.frame_index == 1 and again.status == "completed"
        assert [type(e) for e in session.errors] == [UndecodableFrame]


async def test_fatal_error_ends_the_session_after_the_drained_reply() -> None:
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        done = await session.append_frame(FAKE_JPEG, prompt="fatal")
        assert done.status == "failed"
        for _ in range(100):
            if session.closed is not None:
                break
            await asyncio.sleep(0.01)
        assert session.closed is not None and session.closed.reason == "error"
        assert session.is_closed
        with pytest.raises(SessionClosed) as info:
            await session.append_frame(FAKE_JPEG)
        assert isinstance(info.value.__cause__, ContextExceeded)


async def test_timeout_cancels_the_reply_and_the_session_stays_usable() -> None:
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        with pytest.raises(ResponseTimeout) as info:
            await session.append_frame(FAKE_JPEG, prompt="slow", timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        done = await session.append_frame(FAKE_JPEG, timeout=5)  # waits for the cancelled one
        assert done.frame_index == 1
        sent = [json.loads(m)["type"] for m in srv.received if isinstance(m, str)]
        assert "response.cancel" in sent


async def test_caller_cancellation_cancels_the_reply() -> None:
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        task = asyncio.create_task(session.append_frame(FAKE_JPEG, prompt="slow"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = await session.append_frame(FAKE_JPEG, timeout=5)
        assert done.frame_index == 1 and done.status == "completed"
        sent = [json.loads(m)["type"] for m in srv.received if isinstance(m, str)]
        assert sent.count("response.cancel") == 1


async def test_explicit_cancel_returns_the_cancelled_done() -> None:
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        assert await session.cancel() is None
        stream = session.stream_frame(FAKE_JPEG, prompt="slow")
        first = await stream.__anext__()
        assert first.delta == "echo:" and session.busy
        done = await session.cancel()
        assert done is not None and done.status == "cancelled"
        assert stream.done is done and not session.busy


async def test_close_with_a_reply_in_flight_drains_it() -> None:
    async with fake_server() as srv:
        session = await connect(srv.url, config={})
        stream = session.stream_frame(FAKE_JPEG, prompt="slow")
        await stream.__anext__()
        closed = await session.close()
        assert closed is not None and closed.reason == "client_closed"
        assert stream.done is not None and stream.done.status == "cancelled"


async def test_dropped_socket_is_connection_lost() -> None:
    async with fake_server() as srv, connect(srv.url, config={}) as session:
        with pytest.raises(ConnectionLost):
            await session.append_frame(FAKE_JPEG, prompt="drop")
        assert session.is_closed
        with pytest.raises(ConnectionLost):
            await session.append_frame(FAKE_JPEG)


async def test_exception_inside_async_with_still_closes() -> None:
    async with fake_server() as srv:
        with pytest.raises(RuntimeError):
            async with connect(srv.url, config={}) as session:
                raise RuntimeError("user code failed")
        assert session.closed is not None and session.closed.reason == "client_closed"


async def test_connect_failure_is_connect_error() -> None:
    from tests.realtime.conftest import free_port

    with pytest.raises(sdk_errors.ConnectError):
        await connect(f"ws://127.0.0.1:{free_port()}/v1/realtime", open_timeout=2)


def test_every_wire_code_maps_to_its_protocol_class() -> None:
    for cls in ERROR_CLASSES:
        detail = ErrorDetail(
            type=cls.type,
            code=cls.code,
            message="m",
            event_id="e1",
            session_survives=cls.session_survives,
        )
        exc = sdk_errors.error_from_detail(detail)
        assert type(exc) is cls and exc.event_id == "e1" and exc.message == "m"
    future = ErrorDetail(
        type="server_error", code="brand_new", message="m", event_id=None, session_survives=False
    )
    exc = sdk_errors.error_from_detail(future)
    assert type(exc) is ServerError and "brand_new" in str(exc)
    novel = ErrorDetail(
        type="invalid_request_error", code="x", message="m", event_id=None, session_survives=True
    )
    assert isinstance(sdk_errors.error_from_detail(novel), InvalidRequestError)


async def test_sync_wrapper() -> None:
    async with fake_server() as srv:

        def work() -> tuple[str, list[str], str | None]:
            with sdk_sync.connect(srv.url) as session:
                session.open(instructions="x")
                done = session.append_frame(FAKE_JPEG)
                stream = session.stream_frame(FAKE_JPEG)
                deltas = [d.delta for d in stream]
                assert stream.done is not None and stream.done.frame_index == 1
            assert session.closed is not None
            return done.text, deltas, session.closed.reason

        text, deltas, reason = await asyncio.to_thread(work)
        assert text.startswith("echo:image:") and "".join(deltas) == text
        assert reason == "client_closed"
