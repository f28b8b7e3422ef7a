"""One session in one place: its protocol machine, its engine session (through the hub's
record) and its writer to the session store, whatever transport carries it.

The transports (realtime/connection.py for WebSocket, realtime/http_api.py for HTTP) move bytes
and events; a turn's response.done is made here (`answer`), the only place that drives the
machine's end of a turn. The store writer (realtime/session_store.py) is the session's: the
fence it holds, the lease it keeps, the folds it writes in order, and what rewrites its record
when Redis comes back without it (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from realtime.hub import SessionHub, SessionRecord, TurnOutcome
from realtime.resumption import new_token
from realtime.session_store import MediaKind, StoredSession, digest, held_media
from vllm_realtime_protocol import (
    CapacityExceeded,
    CloseSession,
    EngineError,
    Frame,
    RealtimeError,
    ResponseDoneEvent,
    ResponseStatus,
    ResponseTextDeltaEvent,
    ResumeSession,
    ServerCloseReason,
    ServerEvent,
    SessionConfig,
    SessionProtocol,
    State,
    error_event,
)

log = logging.getLogger("vllm_realtime")


async def answer(
    hub: SessionHub,
    record: SessionRecord,
    frame: Frame,
    *,
    on_delta: Callable[[ResponseTextDeltaEvent], Awaitable[None]] | None = None,
    cancelled: asyncio.Event | None = None,
) -> TurnOutcome:
    """Run one accepted chunk (the hub's turn: engine session, admission caps, costs) and close
    it in the protocol machine: its one response.done, and the error that failed it."""
    report = await hub.run_turn(record, frame, on_delta=on_delta, cancelled=cancelled)
    done = record.protocol.response_finished(
        report.status,
        text=report.text,
        status_reason=report.status_reason,
        usage=report.usage,
        timing=report.timing,
        retention=report.retention,
        resized=report.resized,
    )
    return TurnOutcome(done, report.error)


@dataclass(frozen=True)
class TurnEnd:
    """One turn as its transport goes on from it: the outcome (its response.done carries
    `stored` once the fold is written) and `engine_lost`: the engine died under the turn, and
    nothing was sent yet (a stored session is handed over with no response.done: the client
    sends the chunk again after the resume; else the transport sends the outcome)."""

    outcome: TurnOutcome
    engine_lost: bool = False

    @property
    def done(self) -> ResponseDoneEvent:
        return self.outcome.done

    @property
    def error(self) -> RealtimeError | None:
        return self.outcome.error

    @property
    def close_reason(self) -> ServerCloseReason | None:
        return self.outcome.close_reason


@dataclass
class Rebuilt:
    """A session claimed from the store: its session here, the token issued, and the tokens
    re-prefilled (None: this replica held it, nothing was rebuilt)."""

    session: Session
    token: str
    reprefilled: int | None


class Session:
    """One session's state: the protocol machine, the hub's record (engine session, footprint)
    once opened, the idle clock, and the store writer (`fence` not None: stored)."""

    def __init__(
        self,
        hub: SessionHub,
        owner: str | None,
        protocol: SessionProtocol | None = None,
        *,
        bound_config: SessionConfig | None = None,
    ) -> None:
        self.hub = hub
        self.owner = owner
        self.protocol = protocol if protocol is not None else hub.new_protocol()
        self.record: SessionRecord | None = None
        self.closed = False
        # Opened with a client secret bound to a session config: session.open opens that one.
        self.bound_config = bound_config
        # Before the open the idle clock is the session's own; then the record's (one clock).
        self._idle_since = time.monotonic()
        # The chunk in flight on a WebSocket session (its turn task) and its cancel signal.
        self.turn: asyncio.Task[None] | None = None
        self.cancelled = asyncio.Event()
        # A resumable session outlives its socket: parked (no socket, the turn runs on) until a
        # session.resume takes it up or its grace period ends (`expiry`).
        self.parked = False
        self.expiry: asyncio.Task[None] | None = None
        # server.draining was sent: the session closes as soon as no reply is in flight.
        self.draining = False
        # The engine died under this stored session: it is handed over, and the chunk in
        # flight gets no response.done here (the client sends it again after the resume).
        self.lost_engine = False
        # What the transport does when another replica took the session (the fence moved on).
        self.on_lost: Callable[[], Awaitable[None]] | None = None
        # Session store (issue #39): the fence held (None: not stored), the task that keeps the
        # lease, and the writes of its folds in order.
        self.fence: int | None = None
        self.keeper: asyncio.Task[None] | None = None
        self.store_lock = asyncio.Lock()
        self.store_seq = 0
        # Video sessions: the frame kind each stored (retained, whole) chunk segment holds, the
        # snapshot's next segment index at the last fold, and the frames and deletions not yet
        # written (a failed write retries them with the next fold).
        self.media: dict[int, MediaKind] = {}
        self.media_next = 0
        self.frames_unwritten: dict[int, bytes] = {}
        self.frames_to_drop: set[int] = set()
        # Store outages (docs/reliability.md): whether the record in the store is at the last
        # fold (False: a write failed; the keeper rewrites `last_state` once Redis answers),
        # and what rewrites the whole record if Redis restarts without it: the current token's
        # digest, the Redis run id of the last write, every retained frame's bytes.
        self.store_ok = True
        # Opened while the store was down: the keeper writes the whole record once it answers.
        self.store_pending = False
        self.store_late_sent = False
        self.last_state: StoredSession | None = None
        self.token_digest: str | None = None
        self.store_run: str | None = None
        self.frames_held: dict[int, bytes] = {}

    @property
    def session_id(self) -> str:
        return self.protocol.session_id

    # -- the idle clock

    @property
    def last_activity(self) -> float:
        return self.record.last_activity if self.record is not None else self._idle_since

    def touch(self) -> None:
        """A client event, or the end of a turn: the idle clock restarts."""
        now = time.monotonic()
        if self.record is not None:
            self.record.last_activity = now
        else:
            self._idle_since = now

    # -- turns

    def start_turn(self, turn: Coroutine[Any, Any, None]) -> None:
        """Run an accepted chunk's turn as the session's task (the transport goes on reading)."""
        self.cancelled.clear()
        self.turn = asyncio.create_task(turn)

    def turn_running(self) -> asyncio.Task[None] | None:
        return self.turn if self.turn is not None and not self.turn.done() else None

    async def stop_turn(self) -> None:
        """The session ends: cancel the turn in flight (not the task this runs in) and wait."""
        turn, self.turn = self.turn, None
        if turn is not None and not turn.done() and turn is not asyncio.current_task():
            # Cancelling the consumer inside generate() makes vLLM abort the request.
            self.cancelled.set()
            turn.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await turn

    async def run_turn(
        self,
        frame: Frame,
        *,
        send: Callable[[ServerEvent], Awaitable[None]] | None = None,
    ) -> TurnEnd | None:
        """Run one accepted chunk to its end, the transport's one call per turn: its deltas,
        then its response.done (after its fold is written) and the error that failed it go to
        `send` (None: the caller answers with the outcome's); the deltas stop once `cancelled`
        is set. None when this replica no longer holds the stored session (no second writer,
        ever: the caller lets it go)."""
        assert self.record is not None
        if not await self.still_held():
            return None
        outcome = await answer(
            self.hub, self.record, frame, on_delta=send, cancelled=self.cancelled
        )
        if outcome.close_reason == "engine_error" and not await self.hub.check_engine():
            log.error("engine is down; ending session id=%s", self.session_id[:12])
            return TurnEnd(outcome, engine_lost=True)
        done, stored = await self.store_turn(frame, outcome)
        outcome = dataclasses.replace(outcome, done=done)
        if send is not None:
            await send(done)
        if stored is not None:
            await self.persist_consolidated(stored)
        if send is not None and outcome.error is not None:
            await send(error_event(outcome.error))
        return TurnEnd(outcome)

    async def store_turn(
        self, frame: Frame, outcome: TurnOutcome
    ) -> tuple[ResponseDoneEvent, StoredSession | None]:
        """The turn's response.done with `stored` set, once its fold is written (before the
        client sees it: a client that has its reply can resume it), and the state written."""
        if (self.fence is None and not self.store_pending) or outcome.close_reason is not None:
            return outcome.done, None
        stored = self.stored_state(frame)
        written = await self.persist(stored)
        done = outcome.done.model_copy(update={"stored": written})
        if self.protocol.missed_response is outcome.done:
            self.protocol.missed_response = done
        return done, stored

    def end_in_flight(self, close: CloseSession | None) -> ResponseDoneEvent | None:
        """The session ends with a chunk accepted and unanswered: its response.done (every
        accepted chunk gets one), failed for an engine error, else cancelled."""
        if self.protocol.in_flight is None:
            return None
        failed = close is not None and close.reason == "engine_error"
        status: ResponseStatus = "failed" if failed else "cancelled"
        reason = close.reason if close is not None else "disconnect"
        return self.protocol.response_finished(status, status_reason=reason)

    # -- parking (realtime/resumption.py)

    def can_park(self, server_draining: bool) -> bool:
        """Whether a dropped socket parks this session (else the drop closes it)."""
        config = self.protocol.config
        return (
            config is not None
            and config.resumable is not None
            and self.record is not None
            and not self.draining
            and not server_draining
            and self.protocol.state in (State.IDLE, State.AWAITING_BINARY, State.AWAITING_RESPONSE)
        )

    def park(self, on_expired: Callable[[], Awaitable[None]]) -> None:
        """The socket dropped: keep the session (engine request, KV, reservation) for its grace
        period; a reply in flight runs on and its response.done is kept
        (vllm_realtime_protocol.state). `on_expired`: how the transport ends it after that."""
        self.protocol.detach()
        self.parked = True
        self.hub.metrics.sessions_parked.inc()
        grace = self.grace()
        self.expiry = asyncio.create_task(self._expire_after(grace, on_expired))
        log.info("session parked id=%s grace=%.1fs", self.session_id[:12], grace)

    def parked_elsewhere(self) -> None:
        """Rebuilt from the store, no socket yet: parked until the resume attaches one."""
        self.parked = True
        self.hub.metrics.sessions_parked.inc()

    async def _expire_after(self, grace: float, on_expired: Callable[[], Awaitable[None]]) -> None:
        await asyncio.sleep(grace)
        if not self.parked or self.closed:
            return
        log.info("session expired id=%s", self.session_id[:12])
        self.hub.metrics.sessions_expired.inc()
        self.expiry = None  # the transport's close must not cancel the task it runs in
        await on_expired()

    def unpark(self) -> None:
        if self.parked:
            self.parked = False
            self.hub.metrics.sessions_parked.dec()
        expiry, self.expiry = self.expiry, None
        if expiry is not None and expiry is not asyncio.current_task():
            expiry.cancel()

    # -- the session store (realtime/session_store.py)

    def grace(self) -> float:
        config = self.protocol.config
        assert config is not None and config.resumable is not None
        return config.resumable.grace_s

    async def store_open(self, token: str) -> None:
        """Create the session's record in the store (the session is resumable and stored)."""
        store = self.hub.store
        assert store is not None
        state = self.stored_state()
        try:
            run = await store.run_id()
            fence = await store.create(self.session_id, self.owner, token, self.grace(), state)
        except Exception as exc:
            # The store is down at the open: the session is served, resumable on this replica
            # only (its replies say `stored: false`) until the keeper stores it (_store_late).
            log.warning("session store unreachable at open: %s", type(exc).__name__)
            self.store_pending, self.store_ok = True, False
        else:
            self.fence, self.store_run = fence, run
        self.last_state = state
        self.token_digest = digest(token)
        self.keeper = asyncio.create_task(self.keep_lease())

    def start_keeper(self) -> None:
        if (self.fence is not None or self.store_pending) and self.keeper is None:
            self.keeper = asyncio.create_task(self.keep_lease())

    async def stop_storing(self, *, keep_record: bool) -> None:
        """The session ends here: stop the lease, and delete its record (fenced: not if it
        moved on) unless it is handed over (`keep_record`: a drain, a dead engine)."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None and keeper is not asyncio.current_task():
            keeper.cancel()
        fence, self.fence = self.fence, None
        if self.store_pending and self.store_late_sent:
            # The keeper was cancelled with its record maybe written and its fence not yet
            # noted: a late record has fence 1.
            fence = 1
        self.store_pending = False
        if fence is not None and self.hub.store is not None and not keep_record:
            with contextlib.suppress(Exception):
                await self.hub.store.delete(self.session_id, fence)

    def stored_state(self, frame: Frame | None = None) -> StoredSession:
        """The session as its last fold left it (call between turns, or right after one);
        `frame`: the chunk just answered, whose frame (if any, and retained) is stored with it.
        Notes the frames to write and to delete with this state (`frames_unwritten`,
        `frames_to_drop`)."""
        assert self.record is not None and self.protocol.config is not None
        es = self.record.engine_session
        snapshot = es.snapshot
        kind: MediaKind | None = None
        if frame is not None and frame.kind != "text":
            kind = frame.kind
        media, new_index = held_media(self.media, snapshot, self.media_next, kind)
        if new_index is not None and frame is not None:
            self.frames_unwritten[new_index] = frame.data
            self.frames_held[new_index] = frame.data
        gone = {i for i in (*self.media, *self.frames_unwritten) if i not in media}
        for i in gone:
            if self.frames_unwritten.pop(i, None) is None:
                self.frames_to_drop.add(i)
        for i in [i for i in self.frames_held if i not in media]:
            del self.frames_held[i]
        self.media = media
        if snapshot is not None:
            self.media_next = snapshot.next_index
        return StoredSession(
            config=self.protocol.config,
            frames_total=self.protocol.frames_total,
            responses={str(k): v for k, v in self.protocol.responses.items()},
            turn_open=es.turn_open,
            chunks=es.chunks,
            snapshot=snapshot,
            media=dict(media),
        )

    @classmethod
    async def claim(
        cls,
        hub: SessionHub,
        action: ResumeSession,
        owner: str | None,
        local: Callable[[], Session | None],
    ) -> Rebuilt | None:
        """Claim a session in the store: `local()`'s (this replica held it) or a rebuilt one.
        None if the store does not know the session (it may still be a local-only one)."""
        store = hub.store
        if store is None:
            return None
        token = new_token()
        try:
            claim = await store.claim(
                action.session_id,
                action.resume_token,
                owner,
                token,
                max(hub.config.max_resume_grace_s, 1.0),
            )
        except Exception as exc:
            # The store is unreachable: nothing was claimed, the token still works. Say so
            # with the code of "cannot serve now, retry" (as while draining), not a server bug.
            log.warning("session store claim failed: %s", type(exc).__name__)
            raise CapacityExceeded(
                "the session store is unreachable; retry session.resume shortly",
                event_id=action.event_id,
            ) from None
        if claim is None:
            return None
        held = local()
        run = await _run_id(hub)
        if held is not None and not held.closed:
            held.fence = claim.fence  # the same replica takes it back: no rebuild
            held.token_digest, held.store_run = digest(token), run
            return Rebuilt(held, token, None)
        started = time.perf_counter()
        try:
            record, tokens = await hub.restore_session(
                action.session_id, claim.stored, owner, claim.frames
            )
        except Exception as exc:
            # No room (or no engine, or a rebuild refused) here: the presented token works
            # again elsewhere.
            try:
                await store.give_back(action.session_id, claim.fence, action.resume_token, 60.0)
            except Exception as store_exc:
                log.warning("session store give-back failed: %s", type(store_exc).__name__)
            if not isinstance(exc, RealtimeError):
                log.exception("session rebuild failed")
                exc = EngineError("the session could not be rebuilt on this server")
            exc.event_id = exc.event_id or action.event_id
            raise exc from None
        session = cls(hub, owner, record.protocol)
        session.record = record
        session.fence = claim.fence
        session.token_digest, session.store_run = digest(token), run
        session.last_state = claim.stored
        session.media = dict(claim.stored.media)  # their bytes are in the store already
        session.frames_held = dict(claim.frames)
        snapshot = claim.stored.snapshot
        session.media_next = 0 if snapshot is None else snapshot.next_index
        took = time.perf_counter() - started
        hub.metrics.rebuild_seconds.observe(took)
        hub.metrics.rebuild_tokens.inc(tokens)
        log.info(
            "session rebuilt id=%s tokens=%d in %.3f s (fence %d)",
            action.session_id[:12],
            tokens,
            took,
            claim.fence,
        )
        return Rebuilt(session, token, tokens)

    async def keep_lease(self) -> None:
        """While this replica holds a stored session: refresh its hash, and let the session
        go as soon as another replica has claimed it (the fence moved on)."""
        store = self.hub.store
        assert store is not None
        period = min(1.0, self.grace() / 4)
        while not self.closed and (self.fence is not None or self.store_pending):
            await asyncio.sleep(period)
            if self.store_pending:
                with contextlib.suppress(Exception):  # still down: try again
                    await self._store_late()
                continue
            if self.fence is None:
                break
            try:
                held = await store.refresh(self.session_id, self.fence, self.grace(), probe=True)
                if held and not self.store_ok:
                    await self._rewrite()  # Redis is back: the folds it missed, at once
                elif not held:
                    held = await self._recreate_if_lost()
            except Exception as exc:  # the store is down: keep serving, try again
                if self.store_ok:
                    log.warning("session store refresh failed: %s", type(exc).__name__)
                self.store_ok = False
                continue
            if not held:
                self.keeper = None  # the transport's close must not cancel the task it runs in
                await self.let_go()
                return

    async def let_go(self) -> None:
        """Another replica claimed this session: write nothing more, and the transport ends it
        here (`on_lost`)."""
        if self.closed:
            return
        log.info("session taken over elsewhere id=%s", self.session_id[:12])
        self.fence = None
        if self.on_lost is not None:
            await self.on_lost()

    async def _store_late(self) -> None:
        """The store was down at the open and answers now: write the session's whole record
        (fence 1, its last fold, every retained frame), as the open would have."""
        store = self.hub.store
        assert store is not None and self.token_digest is not None
        assert self.last_state is not None
        # Outside the lock: while Redis is down this call waits, and a turn's fold must not.
        run = await store.run_id()
        async with self.store_lock:
            if not self.store_pending or self.closed:
                return
            self.store_late_sent = True
            done = await store.recreate(
                self.session_id,
                self.owner,
                self.token_digest,
                1,
                self.grace(),
                self.last_state,
                self.frames_held,
            )
            self.store_pending = False
            if not done:  # pragma: no cover (a record under a fresh session id)
                log.warning("session store already holds id=%s", self.session_id[:12])
                return
            self.fence, self.store_run, self.store_ok = 1, run, True
            self.frames_unwritten.clear()
            self.frames_to_drop.clear()
            log.info("session stored id=%s (the store was down at its open)", self.session_id[:12])

    async def token_rotated(self, token: str) -> None:
        """A resume on this replica without the store issued `token`. If the keeper stored the
        session meanwhile (_store_late), the store must know the new token, not the old."""
        async with self.store_lock:
            self.token_digest = digest(token)
            store = self.hub.store
            if self.fence is None or store is None:
                return
            try:
                await store.set_token(self.session_id, self.fence, self.token_digest, self.grace())
            except Exception as exc:
                log.warning("session store token write failed: %s", type(exc).__name__)

    async def _rewrite(self) -> None:
        """Write the last fold again (a write failed while the store was down)."""
        async with self.store_lock:
            if not self.store_ok and self.last_state is not None:
                await self._write(self.last_state)

    async def _recreate_if_lost(self, *, locked: bool = False) -> bool:
        """The fenced call was refused. If Redis restarted without this session's hash, write
        it whole again and go on holding it (True); else another replica holds it (False).
        `locked`: the caller holds `store_lock`."""
        store = self.hub.store
        if store is None or self.fence is None or self.token_digest is None:
            return False
        if self.last_state is None or not await store.lost(self.session_id, self.store_run):
            return False
        if locked:
            return await self._recreate()
        async with self.store_lock:
            return await self._recreate()

    async def _recreate(self) -> bool:
        store = self.hub.store
        assert store is not None and self.fence is not None and self.token_digest is not None
        assert self.last_state is not None
        run = await store.run_id()
        done = await store.recreate(
            self.session_id,
            self.owner,
            self.token_digest,
            self.fence,
            self.grace(),
            self.last_state,
            self.frames_held,
        )
        if done:
            self.store_run, self.store_ok = run, True
            self.frames_unwritten.clear()
            self.frames_to_drop.clear()
            log.info(
                "session store restarted without id=%s: its record is written again",
                self.session_id[:12],
            )
        return bool(done)

    async def still_held(self) -> bool:
        """Before a chunk: whether this replica still holds its stored session (a replica
        whose lease moved on must not run one more chunk: no second writer, ever)."""
        store = self.hub.store
        if self.fence is None or store is None:
            return True
        try:
            if await store.refresh(self.session_id, self.fence, self.grace()):
                return True
            return await self._recreate_if_lost()
        except Exception:
            self.store_ok = False
            return True  # the store is down: the fenced write after the fold still guards

    async def persist(self, state: StoredSession) -> bool:
        """Write a fold's state (`state`, taken right after the turn); whether it is stored."""
        self.store_seq += 1
        async with self.store_lock:
            return await self._write(state)

    async def persist_consolidated(self, state: StoredSession) -> None:
        """Once more after an idle consolidation (the snapshot then holds the consolidated
        window), unless a later fold was written meanwhile."""
        seq = self.store_seq
        es = self.record.engine_session if self.record is not None else None
        if es is not None and es.consolidating and self.fence is not None:
            await es.settle()
            async with self.store_lock:
                if seq == self.store_seq and es.snapshot is not None:
                    # The consolidation dropped remnants: a frame cut by eviction goes now.
                    fresh = self.stored_state()
                    await self._write(
                        dataclasses.replace(state, snapshot=fresh.snapshot, media=fresh.media)
                    )

    async def _write(self, state: StoredSession) -> bool:
        """Write `state` (fenced); whether the store now holds it. A store that does not
        answer: False, and the session goes on (`store_ok` False until a write succeeds)."""
        store = self.hub.store
        if store is None or self.fence is None:
            if self.store_pending:
                self.last_state = state  # what _store_late writes
            return False
        self.last_state = state
        frames, drop = dict(self.frames_unwritten), set(self.frames_to_drop)
        try:
            ok = await store.write(
                self.session_id,
                self.fence,
                state,
                self.grace(),
                frames=frames,
                drop_frames=sorted(drop),
            )
            if not ok and await self._recreate_if_lost(locked=True):
                return True  # written whole (last_state is this state)
        except Exception as exc:
            if self.store_ok:
                log.warning("session store write failed: %s", type(exc).__name__)
            self.store_ok = False
            return False
        if ok:
            for i in frames:
                self.frames_unwritten.pop(i, None)
            self.frames_to_drop -= drop
            if not self.store_ok:
                log.info("session store written again id=%s", self.session_id[:12])
            self.store_ok = True
        self.hub.metrics.store_bytes_per_fold.observe(store.bytes_written_last)
        if not ok:
            await self.let_go()
        return ok


async def _run_id(hub: SessionHub) -> str | None:
    store = hub.store
    try:
        return None if store is None else await store.run_id()
    except Exception:
        return None
