"""A protocol-exact fake server (the real `SessionProtocol`, a scripted "engine"), on loopback.

For SDK unit tests that must be fast and must script what the real engine cannot be made to do
on demand (capacity refusals, engine failures, stalls, dropped sockets).  The reply to a chunk is
steered by its prompt:

* ``slow``        – each delta after 0.3 s (time to cancel or time out);
* ``fatal``       – response.done ``failed``, then ``context_exceeded`` (fatal), session.closed;
* ``late-error``  – response.done ``failed``, then a surviving ``undecodable_frame``;
* ``drop``        – the socket is closed abruptly right after input.ack;
* anything else   – the reply is ``echo:<kind>:<bytes>``, in three deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from vllm_realtime_protocol import (
    CancelResponse,
    CapacityExceeded,
    CloseSession,
    ContextExceeded,
    Limits,
    OpenSession,
    RealtimeError,
    ResponseCreatedEvent,
    ResponseTextDeltaEvent,
    SessionProtocol,
    SubmitFrame,
    UndecodableFrame,
    api_key_from_handshake,
    encode_server_event,
    error_event,
    parse_client_event,
)


@dataclass
class FakeServer:
    url: str
    api_key: str | None
    refuse_opens: int = 0  # answer this many session.open with capacity_exceeded
    received: list[Any] = field(default_factory=list)  # client messages (str or bytes), in order


@contextlib.asynccontextmanager
async def fake_server(
    api_key: str | None = None, refuse_opens: int = 0, max_frame_bytes: int = 4096
) -> AsyncIterator[FakeServer]:
    state = FakeServer("", api_key, refuse_opens)

    def check_key(conn: ServerConnection, request: Request) -> Response | None:
        offered = [
            p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p
        ]
        key = api_key_from_handshake(request.headers.get("Authorization"), offered)
        if state.api_key is not None and key != state.api_key:
            return Response(403, "Forbidden", Headers(), b"")
        return None

    async def handler(ws: ServerConnection) -> None:
        proto = SessionProtocol(
            Limits(server_version="fake", model="fake", max_frame_bytes=max_frame_bytes)
        )
        turn: asyncio.Task[None] | None = None
        cancelled = asyncio.Event()

        async def send(event: Any) -> None:
            await ws.send(encode_server_event(event))

        async def run_turn(action: SubmitFrame) -> None:
            frame = action.frame
            prompt = frame.prompt or ""
            await send(ResponseCreatedEvent(frame_index=frame.frame_index, frame_id=frame.frame_id))
            size = len(frame.data or b"") if frame.data is not None else len(frame.text or "")
            parts = ["echo:", f"{frame.kind}:", str(size)]
            status = "completed"
            text = []
            for part in parts:
                if "slow" in prompt:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(cancelled.wait(), 0.3)
                if cancelled.is_set():
                    status = "cancelled"
                    break
                text.append(part)
                await send(ResponseTextDeltaEvent(frame_index=frame.frame_index, delta=part))
            if "fatal" in prompt or "late-error" in prompt:
                status = "failed"
            await send(proto.response_finished(status, text="".join(text)))  # type: ignore[arg-type]
            if "fatal" in prompt:
                await send(error_event(ContextExceeded("the context is full")))
                close = proto.server_close("error")
                assert close is not None
                await send(close.event)
                await ws.close()
            elif "late-error" in prompt:
                await send(error_event(UndecodableFrame("bad image", event_id="whatever")))

        await send(proto.greeting())
        async for message in ws:
            state.received.append(message)
            try:
                if isinstance(message, bytes):
                    action: Any = proto.receive_binary(message)
                else:
                    action = proto.receive_client_event(parse_client_event(message))
            except RealtimeError as exc:
                await send(error_event(exc))
                continue
            if isinstance(action, OpenSession):
                if state.refuse_opens > 0:
                    state.refuse_opens -= 1
                    proto.open_refused()
                    event_id = parse_client_event(message).event_id  # type: ignore[arg-type]
                    await send(error_event(CapacityExceeded("full", event_id=event_id)))
                    continue
                await send(action.event)
            elif isinstance(action, SubmitFrame):
                await send(action.ack)
                if "drop" in (action.frame.prompt or ""):
                    await ws.close(code=1011)
                    return
                cancelled.clear()
                turn = asyncio.create_task(run_turn(action))
            elif isinstance(action, CancelResponse):
                cancelled.set()
            elif isinstance(action, CloseSession):
                cancelled.set()
                if turn is not None:
                    await turn
                await send(action.event)
                await ws.close()
                return

    async with serve(
        handler,
        "127.0.0.1",
        0,
        process_request=check_key,
        subprotocols=[Subprotocol("vllm-realtime")],
    ) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        state.url = f"ws://127.0.0.1:{port}/v1/realtime"
        yield state
