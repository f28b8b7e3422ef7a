"""Sequences of client sends and server events, with the state the Python ClientProtocol is in
after each: the fixture the JS client's ClientMachine replays
(clients/js/test/machine-sequences.json, checked by clients/js/test/client-machine.test.mjs).

The events are the server's own: a seeded random driver plays the server's SessionProtocol
(the events a connection sends for its actions, as in tests/protocol/test_protocol_client.py)
against the client's machine, and delivers the server's events late at random, so several
sends await their answers at once (a session.update while a chunk waits for its input.ack).
Dropped connections park a resumable session, and a new machine resumes it on the parked
server session (session.resumed, with a missed response.done when the reply finished while
parked). Events are cut to the fields a machine reads.

Regenerate with ``python -m tests.clients.machine_sequences > clients/js/test/machine-sequences.json``;
tests/clients/test_types_drift.py fails when the committed file is not what this gives.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

from vllm_realtime_protocol import (
    CapacityExceeded,
    CloseSession,
    FrameAppendEvent,
    Limits,
    OpenSession,
    RealtimeError,
    ResponseCancelEvent,
    SessionCloseEvent,
    SessionOpenEvent,
    SessionProtocol,
    SessionResumeEvent,
    SessionUpdateEvent,
    State,
    SubmitFrame,
    UpdateSession,
    encode_client_event,
    encode_server_event,
    error_event,
)
from vllm_realtime_protocol.client import ClientProtocol
from vllm_realtime_protocol.errors import InternalError
from vllm_realtime_protocol.events import ClientEvent, ServerEvent

__all__ = ["render", "sequences"]

SEED = 49
COUNT = 80
LIMITS = Limits(server_version="fixture", model="fixture-model", max_frame_bytes=64)
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 16
_SERVER_KEYS = (
    "type",
    "frame_index",
    "reason",
    "next_frame_index",
    "in_flight_frame_index",
    "resume_token",
)
_LIVE = (State.IDLE, State.AWAITING_BINARY, State.AWAITING_RESPONSE)


def _slim_server(event: ServerEvent) -> dict[str, Any]:
    wire = json.loads(encode_server_event(event))
    slim = {k: wire[k] for k in _SERVER_KEYS if k in wire}
    if "config" in wire:
        slim["config"] = {"resumable": wire["config"].get("resumable")}
    if "error" in wire:
        error = wire["error"]
        slim["error"] = {k: error[k] for k in ("code", "session_survives", "event_id")}
    return slim


def _slim_client(event: ClientEvent) -> dict[str, Any]:
    wire = json.loads(encode_client_event(event))
    return {k: wire[k] for k in ("type", "event_id", "binary") if wire.get(k) is not None}


class _Run:
    """One sequence: the server's machine, the client's, and the events between them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ids = 0
        self.tokens = 0
        self.server = SessionProtocol(LIMITS)
        self.client = ClientProtocol()
        self.outbox: list[ServerEvent] = [self.server.greeting()]
        self.steps: list[dict[str, Any]] = []

    def expect(self, refused: str | None = None, internal: bool = False) -> dict[str, Any]:
        c = self.client
        return {
            "state": c.state.value,
            "next": c.next_frame_index,
            "in_flight": c.in_flight_frame_index,
            "unanswered": [i.value for i in c.unanswered],
            "busy": c.busy,
            "refused": refused,
            "internal": internal,
        }

    # -- the client's side

    def deliver(self, count: int | None = None) -> None:
        todo = self.outbox if count is None else self.outbox[:count]
        self.outbox = self.outbox[len(todo) :]
        for event in todo:
            internal = False
            try:
                self.client.receive(event)
            except InternalError:
                internal = True
            self.steps.append(
                {"receive": _slim_server(event), "expect": self.expect(None, internal)}
            )
        if not self.outbox:
            # Everything the server sent has arrived: both machines say the same.
            assert self.client.state is self.server.state, (self.steps[-3:], self.server.state)

    def send(self, event: ClientEvent, admit: bool = True) -> None:
        self.ids += 1
        event = event.model_copy(update={"event_id": f"c{self.ids}"})
        try:
            self.client.send(event)
        except RealtimeError as exc:
            self.steps.append({"send": _slim_client(event), "expect": self.expect(exc.code)})
            return
        self.steps.append({"send": _slim_client(event), "expect": self.expect()})
        self._server(lambda: self.server.receive_client_event(event), admit, event.event_id)

    def send_binary(self, data: bytes) -> None:
        try:
            self.client.send_binary(data)
        except RealtimeError as exc:
            self.steps.append({"binary": len(data), "expect": self.expect(exc.code)})
            return
        self.steps.append({"binary": len(data), "expect": self.expect()})
        self._server(lambda: self.server.receive_binary(data), True, None)

    def lost(self) -> bool:
        """The connection drops; True if the sequence goes on (a resume)."""
        parks = (
            self.server.state in _LIVE
            and self.server.config is not None
            and self.server.config.resumable is not None
        )
        self.client.connection_lost()
        self.steps.append({"lost": True, "expect": self.expect()})
        if not parks:
            return False
        self.server.detach()
        if self.server.state is State.PARKED_AWAITING_RESPONSE and self.rng.random() < 0.5:
            self.server.response_finished("completed")  # kept for session.resumed
        # A new connection, and a new machine, resume the parked session (the new
        # connection's server machine looks it up; the parked one answers).
        token = self.client.resume_token or "tok-0"
        self.client = ClientProtocol()
        self.steps.append({"new_machine": True})
        self.outbox = [SessionProtocol(LIMITS).greeting()]
        self.deliver()
        self.ids += 1
        resume = SessionResumeEvent(event_id=f"c{self.ids}", session_id="sess", resume_token=token)
        self.client.send(resume)
        self.steps.append({"send": _slim_client(resume), "expect": self.expect()})
        self.tokens += 1
        self.outbox.append(self.server.resumed(f"tok-{self.tokens}"))
        self.deliver()
        return True

    # -- the server's side (what a connection sends for each action)

    def _server(self, step: Any, admit: bool, event_id: str | None) -> None:
        try:
            action = step()
        except RealtimeError as exc:
            self.outbox.append(error_event(exc))
            if not exc.session_survives:
                self.server_close("error")
            return
        if isinstance(action, OpenSession):
            if admit:
                self.outbox.append(action.event)
            else:  # admission refused it, as the connection does on capacity
                self.server.open_refused()
                self.outbox.append(error_event(CapacityExceeded("full", event_id=event_id)))
        elif isinstance(action, SubmitFrame):
            self.outbox.append(action.ack)
        elif isinstance(action, UpdateSession):
            self.outbox.append(action.event)
        elif isinstance(action, CloseSession):
            self._finish(action)

    def reply_done(self, status: Any) -> None:
        if self.server.state is State.AWAITING_RESPONSE:
            self.outbox.append(self.server.response_finished(status))

    def server_close(self, reason: Any) -> None:
        action = self.server.server_close(reason)
        if action is not None:
            self._finish(action)

    def _finish(self, action: CloseSession) -> None:
        if action.in_flight is not None:  # drained
            self.outbox.append(self.server.response_finished("cancelled"))
        self.outbox.append(action.event)


# Operations and how often each is drawn: delivery often, so most sends are answered at once.
_OPS = ["text", "image", "announce", "binary", "deliver", "done", "cancel", "update", "open"]
_OPS += ["close", "server_close", "lost", "late"]
_WEIGHTS = [5, 2, 3, 3, 6, 4, 2, 3, 1, 1, 1, 1, 3]


def _one(rng: random.Random) -> list[dict[str, Any]]:
    run = _Run(rng)
    run.deliver()
    resumable = rng.random() < 0.5
    modality = rng.choice(["video", "text"])
    if rng.random() < 0.85:
        fields: dict[str, Any] = {"modality": modality}
        if resumable:
            fields["resumable"] = {"grace_s": 5}
        run.send(SessionOpenEvent.model_validate(fields), admit=rng.random() < 0.9)
        run.deliver()
    jpeg = base64.b64encode(JPEG).decode("ascii")
    for _ in range(rng.randint(4, 26)):
        op = rng.choices(_OPS, weights=_WEIGHTS)[0]
        if op == "text":
            run.send(FrameAppendEvent(text="hi"))
        elif op == "image":
            run.send(FrameAppendEvent(image=rng.choice([jpeg, "bad"])))
        elif op == "announce":
            run.send(FrameAppendEvent(binary=True))
        elif op == "binary":
            run.send_binary(rng.choice([JPEG, b"junk", JPEG * 8]))
        elif op == "deliver":
            run.deliver()
        elif op == "late":  # deliver only the oldest event: the rest comes later
            run.deliver(1)
        elif op == "done":
            run.reply_done(rng.choice(["completed", "cancelled", "failed"]))
        elif op == "cancel":
            run.send(ResponseCancelEvent())
        elif op == "update":
            change = rng.choice([{"frame_format": "png"}, {"modality": "text"}])
            run.send(SessionUpdateEvent.model_validate(change))
        elif op == "open":
            run.send(SessionOpenEvent(modality="text"), admit=rng.random() < 0.5)
        elif op == "close":
            run.send(SessionCloseEvent())
        elif op == "server_close":
            run.server_close(rng.choice(["engine_error", "idle_timeout", "server_shutdown"]))
        elif op == "lost" and not run.lost():
            return run.steps
        if run.client.state is State.CLOSED and not run.outbox:
            break
    run.deliver()
    return run.steps


def sequences(seed: int = SEED, count: int = COUNT) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    return [_one(rng) for _ in range(count)]


def render() -> str:
    """The fixture as committed: one step a line."""
    blocks = []
    for steps in sequences():
        lines = ",\n".join(f"    {json.dumps(step, separators=(',', ':'))}" for step in steps)
        blocks.append(f"  [\n{lines}\n  ]")
    return "[\n" + ",\n".join(blocks) + "\n]\n"


if __name__ == "__main__":
    print(render(), end="")
