"""The session layer shared by the WebSocket and HTTP adapters: registry, admission, one turn.

Admission control: a session holds KV blocks even while it waits for its next chunk, so sessions
that together need more blocks than the engine has can deadlock it (vllm#49439). Every session
reserves its peak footprint (realtime/admission.py: a bounded session its sinks, window, chunk
and reply; an unbounded one the whole context) and is refused at open with `capacity_exceeded`
when the reservations would pass the engine's pool. Chunks are held to the sizes the footprint
assumed: text is tokenized and capped (`limits.max_chunk_tokens`), frames are capped by the
model's processor.

Admission by compute (realtime/compute.py): every answered chunk that had the engine to itself
is measured (prefill, per reply token), per kind; a session is admitted only while the open
sessions' declared paces (`limits.frames_per_s`) times those costs fit a headroom of the
engine's time. A few chunks of each kind are measured at start-up, before anyone is admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from realtime import __version__
from realtime.admission import Admission, Footprint, MediaBounds, media_bounds_or_default
from realtime.compute import BUSY_CORES, ChunkCost, ChunkKind, ChunkTiming, CostModel
from realtime.config import ServerConfig
from realtime.engine_session import (
    ChunkFinished,
    ChunkWriting,
    EngineFacts,
    EngineSession,
    FrameLimits,
    TurnResult,
    chat_format_of,
    kv_pool,
    served_model_family,
)
from realtime.media import MAX_CLIP_FRAMES, decode_clip, decode_image
from realtime.metrics import Metrics
from realtime.prompt_format import ChatFormat
from realtime.session_store import SessionStore, StoredSession
from realtime.structured import validate_format
from vllm_realtime_protocol import (
    EngineError,
    Frame,
    FrameResize,
    InvalidEvent,
    InvalidRequestError,
    Limits,
    RealtimeError,
    Reservation,
    ResponseDoneEvent,
    ResponseStatus,
    ResponseTextDeltaEvent,
    RetentionConfig,
    RetentionState,
    ServerCloseReason,
    SessionConfig,
    SessionNotFound,
    SessionProtocol,
    Timing,
    Usage,
    new_session_id,
)

log = logging.getLogger("vllm_realtime")

CALIBRATION_CHUNKS = 4
"""Chunks of each kind measured at start-up (after one that warms the engine up)."""
CALIBRATION_REPLY_TOKENS = 8
CALIBRATION_TRIES = 3
"""Calibrations of a kind taken while other processes keep the CPU busy before the last one
is kept as provisional (realtime/compute.py, BUSY_CORES)."""


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall, the machine's busy CPU seconds over all cores, this process tree's CPU seconds),
    or None where /proc/stat cannot be read."""
    import os

    try:
        import psutil  # a dependency of vLLM

        with open("/proc/stat", encoding="ascii") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except (ImportError, OSError, ValueError):
        return None
    hz = float(os.sysconf("SC_CLK_TCK"))
    # user nice system idle iowait irq softirq steal: idle and iowait are not busy.
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / hz
    ours = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            ours += t.user + t.system
        except psutil.Error:
            pass
    return time.monotonic(), busy, ours


def calibration_frame(kind: ChunkKind, index: int) -> Frame:
    """A chunk like a camera's: a 224×224 JPEG of noise (its size, not its content, sets its
    cost), or a short text turn."""
    if kind == "text":
        text = f"Turn {index}: describe what a kitchen camera sees, in one sentence."
        return Frame(
            frame_index=index,
            frame_id=None,
            kind="text",
            media_format=None,
            data=text.encode(),
            text=text,
            prompt=None,
            timestamp=None,
        )
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(index).integers(0, 255, (224, 224, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=80)
    return Frame(
        frame_index=index,
        frame_id=None,
        kind="image",
        media_format="jpeg",
        data=buf.getvalue(),
        text=None,
        prompt=None,
        timestamp=None,
    )


def decode_stored_frames(
    stored: StoredSession, frames: dict[int, bytes], max_frame_pixels: int | None = None
) -> dict[int, tuple[str, Any]]:
    """A stored video session's retained frames, decoded as the live session decoded them
    (resized to its frame cap)."""
    media: dict[int, tuple[str, Any]] = {}
    for index, kind in stored.media.items():
        data = frames.get(index)
        if data is None:
            raise EngineError(f"the session's record lacks the frame of segment {index}")
        decoded = (
            decode_image(data, max_pixels=max_frame_pixels)
            if kind == "image"
            else decode_clip(data, max_frame_pixels=max_frame_pixels)
        )
        media[index] = (kind, decoded)
    return media


@dataclass
class SessionRecord:
    """One open session: its state machine, its engine request, its reservation."""

    protocol: SessionProtocol
    engine_session: EngineSession
    footprint: Footprint
    owner: str | None  # API key (or None) of whoever opened it; only they may act on it
    transport: Literal["websocket", "http"] = "websocket"
    # The session's idle clock (the last client event, or a turn's start or end): kept here
    # only, for every transport (realtime/session.py touches it for WebSocket sessions).
    last_activity: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    bounded: bool = False
    # Tokens of the instructions' system turn (counted at open; pinned in the first chunk).
    instructions_tokens: int = 0
    # sampling.max_tokens at open: admission reserved a reply of this size, so a session.update
    # may lower it but not raise it above this.
    reply_tokens_reserved: int = 0

    @property
    def reserved_blocks(self) -> int:
        return self.footprint.blocks


def key_matches(expected: str | None, given: str | None) -> bool:
    """Whether `given` is the key `expected` (anything matches None), in constant time."""
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


@dataclass(frozen=True)
class TurnReport:
    """What one turn's run left for its response.done (the session layer, realtime/session.py,
    turns it into that event through the protocol machine), and the error that failed it."""

    status: ResponseStatus
    text: str
    status_reason: str | None
    usage: Usage
    timing: Timing
    retention: RetentionState
    resized: FrameResize | None
    error: RealtimeError | None = None


@dataclass(frozen=True)
class TurnOutcome:
    """What one turn ended with: always its response.done; the error that failed it, if any."""

    done: ResponseDoneEvent
    error: RealtimeError | None = None

    @property
    def close_reason(self) -> ServerCloseReason | None:
        """Why the session must end now (None: it goes on), the same for every transport."""
        if isinstance(self.error, EngineError):
            return "engine_error"
        if self.error is not None and not self.error.session_survives:
            return "error"
        return None


class SessionHub:
    def __init__(self, engine: Any, config: ServerConfig, model_name: str) -> None:
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.sessions: dict[str, SessionRecord] = {}
        self.metrics = Metrics()
        self.healthy = True
        self.engine_failure: str | None = None
        facts = EngineFacts.of(engine)
        self.facts = facts
        self.max_model_len = facts.max_model_len
        self.multimodal = facts.multimodal
        # Set by start() from the engine's KV pool.
        self.block_size = 0
        self.usable_blocks = 0
        self.max_position = facts.max_position
        if config.retention_max_position is not None:
            self.max_position = min(self.max_position, config.retention_max_position)
        # Tokens a frame's image or clip can add beyond its text (the frame cap, else the
        # processor's max pixels).
        self.processor_config = facts.processor_config
        self.media: MediaBounds | None = (
            media_bounds_or_default(facts.processor_config, config.max_frame_pixels)
            if self.multimodal
            else None
        )
        self.tokenizer: Any = None
        self._writing: ChunkWriting | None = None
        self.engine_slots = facts.engine_slots
        self._admission: Admission | None = None  # set by start(), with the KV pool
        self._chat: ChatFormat | None = None  # set by start(), from the model's chat template
        pinned: dict[ChunkKind, ChunkCost] = {}
        if config.chunk_cost_ms is not None:
            pinned = {k: ChunkCost(config.chunk_cost_ms, 0.0) for k in ("frame", "text")}
        self.costs = CostModel(pinned=pinned)
        # Chunks in the engine now, and how many ever started: a chunk is measured only if no
        # other one ran beside it (its time to first token is then its own, not a queue's).
        self._in_flight = 0
        self._turns_started = 0
        # The shared session store (`serve --session-store`), connected by start().
        self.store: SessionStore | None = None
        # The model's placeholder token per frame kind, where a video session can be stored
        # (set by start(); None: video sessions stay resumable on their own replica only).
        self.pad_ids: dict[str, int] | None = None

    def stored(self, config: SessionConfig) -> bool:
        """Whether a session is kept in the session store: resumable, bounded in the engine
        (its snapshot is its window), and text, or video on a model whose frames a rebuild
        can pass again (`pad_ids`: each image or clip is one run of one placeholder token)."""
        return (
            self.store is not None
            and config.resumable is not None
            and config.retention.enabled
            and (config.modality == "text" or self.pad_ids is not None)
        )

    async def start(self) -> None:
        # A family the engine hooks are not proven on is refused here, by name, with the
        # reason (retention/vllm_adapter/model_families.py), before anything is served.
        family, positions = served_model_family(self.engine)
        log.info("model family: %s (%s positions)", family, positions)
        self.pad_ids = self.facts.frame_pad_ids
        if self.config.session_store is not None and self.store is None:
            replica = f"{socket.gethostname()}:{self.config.port}:{secrets.token_hex(4)}"
            self.store = SessionStore.connect(self.config.session_store, replica)
            await self.store.ping()  # an unreachable store stops the start-up here
            log.info("session store: %s (replica %s)", self.config.session_store, replica)
        pool = await kv_pool(self.engine)
        if pool.kv_cache_groups != 1:
            raise RuntimeError(
                "hybrid KV-cache configs (more than one KV-cache group) are not supported"
            )
        self.block_size = pool.block_size
        self.usable_blocks = pool.usable_blocks
        self._admission = Admission.for_server(
            self.config,
            max_model_len=self.max_model_len,
            max_position=self.max_position,
            block_size=self.block_size,
            usable_blocks=self.usable_blocks,
            media=self.media,
            engine_slots=self.engine_slots,
            processor_config=self.processor_config,
        )
        self.tokenizer = self.engine.get_tokenizer()
        # A template the server cannot write chunks with stops the start-up here (not guessed).
        self._chat = chat_format_of(self.engine, self.config.chat_template)
        self.metrics.kv_blocks_total.set(self.usable_blocks)
        self.metrics.kv_block_size.set(self.block_size)
        if self.facts.kv_cache_memory_bytes:
            self.metrics.kv_pool_bytes.set(self.facts.kv_cache_memory_bytes)
        default = SessionConfig(modality="video" if self.multimodal else "text")
        fp = self.admission.admit(default, instructions_tokens=0).footprint
        fit = self.usable_blocks // max(fp.blocks, 1)
        self.metrics.default_sessions_fit.set(fit)
        await self.measure_chunk_costs()
        log.info(
            "KV pool: %d blocks x %d tokens = %d tokens; a default %s session reserves %d blocks "
            "(%s); about %d such sessions fit (vllm_realtime_default_sessions_fit)",
            self.usable_blocks,
            self.block_size,
            self.usable_blocks * self.block_size,
            default.modality,
            fp.blocks,
            fp.describe(),
            fit,
        )
        if fit == 0:
            log.warning(
                "the KV pool holds no default %s session: every such session.open gets "
                "capacity_exceeded; give a larger --kv-cache-memory-bytes or a smaller "
                "--max-model-len",
                default.modality,
            )

    def limits(self) -> Limits:
        return Limits(
            max_frame_bytes=self.config.max_frame_bytes,
            max_sessions=self.config.max_sessions,
            idle_timeout_s=self.config.idle_timeout_s,
            max_tokens_cap=min(1024, self.max_model_len // 2),
            max_resume_grace_s=self.config.max_resume_grace_s,
            max_chunk_tokens=self.config.max_chunk_tokens,
            max_instructions_tokens=self.config.max_instructions_tokens,
            max_clip_frames=MAX_CLIP_FRAMES if self.multimodal else None,
            max_frame_pixels=self.config.max_frame_pixels if self.multimodal else None,
            server_version=__version__,
            model=self.model_name,
        )

    def new_protocol(self) -> SessionProtocol:
        return SessionProtocol(self.limits(), session_id=new_session_id())

    # -- admission (the arithmetic is realtime/admission.py)

    @property
    def admission(self) -> Admission:
        if self._admission is None:
            raise RuntimeError("SessionHub.start() reads the KV pool first")
        return self._admission

    @property
    def chat(self) -> ChatFormat:
        """How this model's chunks are written (its turn delimiters and media placeholders)."""
        if self._chat is None:
            raise RuntimeError("SessionHub.start() reads the chat format first")
        return self._chat

    def admit(self, config: SessionConfig, *, instructions_tokens: int) -> tuple[Footprint, bool]:
        """What admission reserves for a session, and whether that is its bounded footprint."""
        admitted = self.admission.admit(config, instructions_tokens=instructions_tokens)
        if admitted.whole_context_because is not None:
            log.info(
                "session budget reserved as a whole context: %s", admitted.whole_context_because
            )
        return admitted.footprint, admitted.bounded

    def reservation_blocks(self, config: SessionConfig | None = None) -> int:
        """Blocks admission reserves for a session opened with `config` (None: the defaults)
        and no instructions."""
        if config is None:
            config = SessionConfig(modality="video" if self.multimodal else "text")
        return self.admission.admit(config, instructions_tokens=0).footprint.blocks

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _instructions_tokens(self, config: SessionConfig) -> int:
        # The opening as a first chunk writes it: the system turn, else the template's preamble.
        opening = self.chat.opening(config.instructions)
        if not opening:
            return 0
        n = self.count_tokens(opening)
        if config.instructions:
            self.admission.check_instructions(n)
        return n

    def reserved_total(self) -> int:
        return sum(r.reserved_blocks for r in self.sessions.values())

    async def open_session(
        self,
        protocol: SessionProtocol,
        config: SessionConfig,
        owner: str | None,
        transport: Literal["websocket", "http"] = "websocket",
        *,
        rebuilding: bool = False,
    ) -> SessionRecord:
        """Admit and open a session. `rebuilding`: one the fleet admitted already, taken over
        from the store (its replica died or drained): KV and counts still bind, compute does
        not, since refusing it would lose a session rather than decline a new one."""
        # Ask the engine (a cheap local flag in AsyncLLM), not only the watchdog's last verdict:
        # right after the engine died a session.open must already be refused with engine_error.
        if not await self.check_engine():
            raise EngineError(f"the engine is down: {self.engine_failure}")
        mine = sum(1 for r in self.sessions.values() if r.owner == owner)
        self.admission.check_session_counts(len(self.sessions), mine)
        validate_format(config.sampling.response_format, "session.open.sampling.response_format")
        instructions_tokens = self._instructions_tokens(config)
        fp, bounded = self.admit(config, instructions_tokens=instructions_tokens)
        self.admission.check_pool(fp, self.reserved_total(), len(self.sessions))
        if not rebuilding:
            self.admission.check_compute(config, self.open_configs(), self.costs)
        session = EngineSession(
            self.engine,
            protocol.session_id,
            config.sampling,
            self.admission.retention_args(config),
            snapshots=self.stored(config),
        )
        record = SessionRecord(
            protocol,
            session,
            fp,
            owner,
            transport,
            bounded=bounded,
            instructions_tokens=instructions_tokens,
            reply_tokens_reserved=config.sampling.max_tokens,
        )
        self.sessions[protocol.session_id] = record
        self.metrics.sessions_open.set(len(self.sessions))
        self.metrics.kv_blocks_reserved.set(self.reserved_total())
        log.info("session opened id=%s modality=%s", protocol.session_id[:12], config.modality)
        return record

    def update_session(self, record: SessionRecord, config: SessionConfig) -> None:
        """Apply a session.update's settings to the session's later chunks (the state machine
        has checked the fixed settings); refuse what admission or the grammar backend cannot
        take, naming the field."""
        reserved = record.reply_tokens_reserved
        if config.sampling.max_tokens > reserved:
            raise InvalidRequestError(
                f"session.update.sampling.max_tokens: {config.sampling.max_tokens} is more than "
                f"the {reserved} tokens per reply admission reserved at session.open; open a new "
                "session for longer replies",
                param="sampling.max_tokens",
            )
        try:
            validate_format(
                config.sampling.response_format, "session.update.sampling.response_format"
            )
        except RealtimeError as exc:
            exc.param = exc.param or "sampling.response_format"
            raise
        record.engine_session.update_sampling(config.sampling)

    def open_configs(self) -> list[SessionConfig]:
        return [c for r in self.sessions.values() if (c := r.protocol.config) is not None]

    async def restore_session(
        self,
        session_id: str,
        stored: StoredSession,
        owner: str | None,
        frames: dict[int, bytes] | None = None,
    ) -> tuple[SessionRecord, int]:
        """Rebuild a session another replica held, from its record in the session store: the
        same id, config and counters, and its retained tokens re-prefilled once (a video
        session's with its retained `frames`, the bytes the client sent, by segment index).
        The session and the tokens re-prefilled."""
        protocol = SessionProtocol.restored(
            self.limits(),
            session_id=session_id,
            config=stored.config,
            frames_total=stored.frames_total,
            responses=stored.responses,  # type: ignore[arg-type]  # statuses, as written
        )
        record = await self.open_session(
            protocol, stored.config, owner, "websocket", rebuilding=True
        )
        tokens = 0
        try:
            if stored.snapshot is not None:
                media = None
                if stored.config.modality == "video":
                    media = await asyncio.to_thread(
                        decode_stored_frames,
                        stored,
                        frames or {},
                        self.admission.frame_cap(stored.config),
                    )
                tokens = await record.engine_session.restore(
                    stored.snapshot,
                    chunks=stored.chunks,
                    turn_open=stored.turn_open,
                    media=media,
                    pad_ids=self.pad_ids,
                    processor_kwargs=self.admission.frame_processor_kwargs(stored.config),
                )
        except BaseException:
            await self.close_session(record)
            raise
        return record, tokens

    def find(
        self, session_id: str, owner: str | None, transport: Literal["websocket", "http"]
    ) -> SessionRecord:
        """The open session `session_id` of `transport` that `owner` may act on."""
        record = self.sessions.get(session_id)
        # Someone else's session answers exactly like a missing one: ids are not probeable.
        if record is None or record.transport != transport or not key_matches(record.owner, owner):
            raise SessionNotFound("no such session")
        return record

    def of_transport(self, transport: Literal["websocket", "http"]) -> dict[str, SessionRecord]:
        return {sid: r for sid, r in self.sessions.items() if r.transport == transport}

    def kv_blocks_held(self) -> int:
        """Blocks the open sessions hold, as their last replies reported (no engine call)."""
        held = 0
        for record in self.sessions.values():
            report = record.engine_session.last_report
            if report is not None:
                held += report.kv_blocks_held
        return held

    def reservation(self, record: SessionRecord) -> Reservation:
        fp = record.footprint
        return Reservation(
            kv_blocks=fp.blocks,
            tokens=fp.tokens,
            block_size=self.block_size,
            bounded=record.bounded,
        )

    async def close_session(self, record: SessionRecord, *, abort: bool = True) -> None:
        if self.sessions.pop(record.protocol.session_id, None) is None:
            return
        self.metrics.sessions_open.set(len(self.sessions))
        self.metrics.kv_blocks_reserved.set(self.reserved_total())
        if abort:
            await record.engine_session.abort()
        log.info("session closed id=%s", record.protocol.session_id[:12])

    # -- one turn

    def check_chunk(self, record: SessionRecord, frame: Frame, prompt: dict[str, Any]) -> None:
        """Refuse a chunk larger than admission assumed, or one the context cannot take: its
        prompt text (template, turn text, frame prompt) is tokenized exactly here, the rest is
        `Admission.check_chunk`."""
        config = record.protocol.config
        assert config is not None
        text_tokens = self.count_tokens(prompt["prompt"])
        if record.engine_session.chunks == 0:
            text_tokens -= record.instructions_tokens  # counted at open, pinned
        clip = prompt.get("multi_modal_data", {}).get("video")  # (frames, metadata), decode_clip
        self.admission.check_chunk(
            config,
            text_tokens=text_tokens,
            clip_frames=None if clip is None else int(clip[0].shape[0]),
            is_frame=frame.kind != "text",
            held_tokens=record.engine_session.tokens_in_context,
        )

    async def run_turn(
        self,
        record: SessionRecord,
        frame: Frame,
        *,
        on_delta: Callable[[ResponseTextDeltaEvent], Awaitable[None]] | None = None,
        cancelled: asyncio.Event | None = None,
    ) -> TurnReport:
        """Run one accepted chunk: its deltas go to `on_delta` as they come (until `cancelled`);
        the report holds what its response.done says and the error that failed it, if any."""
        config = record.protocol.config
        assert config is not None
        record.last_activity = time.monotonic()
        started = time.perf_counter()

        async def delta(text: str) -> None:
            if on_delta is not None and (cancelled is None or not cancelled.is_set()):
                await on_delta(ResponseTextDeltaEvent(frame_index=frame.frame_index, delta=text))

        result = await self._run_chunk(
            record.engine_session,
            frame,
            config,
            on_delta=delta,
            check=lambda prompt: self.check_chunk(record, frame, prompt),
        )
        status: ResponseStatus = "completed"
        reason: str | None = None
        usage = Usage()
        timing = Timing()
        item = result.finished
        if item is not None:
            usage = Usage(
                prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens
            )
            timing = Timing(queue_ms=result.queue_ms, ttft_ms=item.ttft_ms, total_ms=item.total_ms)
            if not frame.reply:
                status = "ingested"
            elif item.finish_reason == "length":
                status, reason = "incomplete", "max_tokens"
        if result.error is None and cancelled is not None and cancelled.is_set():
            status, reason = "cancelled", "client_cancelled"
        if result.error is not None:
            status, reason = "failed", result.error.code
            if isinstance(result.error, EngineError):
                self.metrics.engine_errors.inc()
        retention = self.retention_state(record)
        total_ms = (time.perf_counter() - started) * 1e3
        if timing.total_ms is None:
            timing = Timing(total_ms=total_ms)
        self.metrics.frames.inc()
        self.metrics.frame_latency.observe(total_ms / 1e3)
        record.last_activity = time.monotonic()
        return TurnReport(
            status, result.text, reason, usage, timing, retention, result.resized, result.error
        )

    async def _run_chunk(
        self,
        es: EngineSession,
        frame: Frame,
        config: SessionConfig,
        *,
        on_delta: Callable[[str], Awaitable[None]] | None = None,
        check: Callable[[dict[str, Any]], None] | None = None,
        measure: bool = True,
        reply_tokens: int | None = None,
    ) -> TurnResult:
        """One chunk through `es.run_turn`, for a session's turn and a calibration alike: the
        frame cap of `config` (a calibration session's is the server's), and the chunk's cost
        into `self.costs` if it ran alone."""
        frames = FrameLimits(
            self.admission.frame_cap(config), self.admission.frame_processor_kwargs(config)
        )
        kind: ChunkKind = "text" if frame.kind == "text" else "frame"
        return await es.run_turn(
            frame,
            config,
            self.writing,
            frames=frames,
            on_delta=on_delta,
            check=check,
            meter=lambda: self._metered(kind, measure=measure),
            reply_tokens=reply_tokens,
        )

    async def measure_chunk_costs(self) -> None:
        """Measure what a chunk of each kind costs, on a session of the server's own, before
        anyone is admitted: sessions that arrive together are admitted on these figures."""
        if self.admission.compute_headroom is None or self.costs.pinned:
            return
        kinds: list[ChunkKind] = ["text"]
        if self.multimodal and self.chat.image is not None:
            kinds.append("frame")
        for kind in kinds:
            for attempt in range(CALIBRATION_TRIES):
                busy = await self._calibrate(kind, warm_up=attempt == 0)
                if busy < BUSY_CORES:
                    break
                log.info(
                    "compute: other processes kept %.1f cores busy while a %s chunk was "
                    "measured; measuring again",
                    busy,
                    kind,
                )
            else:
                self.costs.mark_provisional(kind)
                log.warning(
                    "compute: the %s chunk cost was measured while other processes kept %.1f "
                    "cores busy (%d tries); admission uses it until a chunk that runs alone "
                    "measures again",
                    kind,
                    busy,
                    CALIBRATION_TRIES,
                )
            cost = self.costs.cost(kind)
            log.info(
                "compute: a %s chunk costs %s; admission fills %.0f%% of a session's period",
                kind,
                "unmeasured"
                if cost is None
                else f"{cost.prefill_ms:.0f} ms prefill + {cost.step_ms or 0:.1f} ms a decode "
                f"step ({cost.per_token_ms:.1f} ms marginal) per reply token",
                100 * (self.admission.compute_headroom or 0),
            )

    async def _calibrate(self, kind: ChunkKind, *, warm_up: bool = True) -> float:
        """Measure a few chunks of `kind` on a session of the server's own (after one that
        warms the engine up, the first time); returns the cores other processes kept busy
        meanwhile (the measurement is replaced on each call)."""
        from realtime.compute import other_cpu_cores

        self.costs.forget(kind)
        before = _cpu_seconds()
        config = SessionConfig(
            modality="video" if kind == "frame" else "text",
            retention=RetentionConfig(enabled=False),
        )
        es = EngineSession(self.engine, "calibrate_" + secrets.token_hex(8), config.sampling, None)
        try:
            first = 0 if warm_up else 1
            for i in range(first, CALIBRATION_CHUNKS + 1):
                # A fixed reply length: the inter-token step needs two tokens or more. The
                # first chunk warms the engine up and is not measured.
                result = await self._run_chunk(
                    es,
                    calibration_frame(kind, i),
                    config,
                    measure=i > 0,
                    reply_tokens=CALIBRATION_REPLY_TOKENS,
                )
                if result.error is not None:
                    raise result.error
        finally:
            await es.abort()
        after = _cpu_seconds()
        if before is None or after is None:
            return 0.0
        return other_cpu_cores(after[1] - before[1], after[2] - before[2], after[0] - before[0])

    @contextlib.contextmanager
    def _metered(
        self, kind: ChunkKind, *, measure: bool = True
    ) -> Iterator[Callable[[ChunkFinished], None]]:
        """Around one chunk's time in the engine: its cost goes into `self.costs` if it ran
        alone (no other chunk in the engine beside it, from its start to its end)."""
        alone = self._in_flight == 0
        self._in_flight += 1
        self._turns_started += 1
        started_as = self._turns_started

        def observe(item: ChunkFinished) -> None:
            ran_alone = alone and self._turns_started == started_as
            if measure and ran_alone and item.ttft_ms is not None:
                timing = ChunkTiming(
                    ttft_ms=item.ttft_ms,
                    total_ms=item.total_ms,
                    prompt_tokens=item.prompt_tokens,
                    completion_tokens=item.completion_tokens,
                )
                self.costs.observe(kind, timing)

        try:
            yield observe
        finally:
            self._in_flight -= 1

    @property
    def writing(self) -> ChunkWriting:
        """How this server writes chunks (its chat format, and the reply close's tokens)."""
        if self._writing is None:
            self._writing = ChunkWriting.of(self.chat, self.tokenizer, multimodal=self.multimodal)
        return self._writing

    def retention_state(self, record: SessionRecord) -> RetentionState:
        """The session's state for response.done, from EngineCore's last report (it rides on
        the reply's own output: no call into EngineCore)."""
        es = record.engine_session
        report = es.last_report
        if report is None or report.error is not None:
            # No chunk boundary yet, or the engine ended the session (its blocks are freed).
            return RetentionState(
                frames_retained=es.chunks, tokens_retained=es.tokens_in_context, kv_blocks_held=0
            )
        counters = report.retention
        return RetentionState(
            frames_retained=es.chunks if counters is None else counters.chunks_retained,
            frames_evicted=0 if counters is None else counters.chunks_evicted,
            tokens_retained=report.tokens_in_context,
            kv_blocks_held=report.kv_blocks_held,
            consolidations=0 if counters is None else counters.consolidations,
        )

    # -- engine failure and shutdown

    def mark_engine_failed(self, why: str) -> None:
        if self.healthy:
            log.error("engine failed: %s", why)
        self.healthy = False
        self.engine_failure = why

    async def check_engine(self) -> bool:
        if not self.healthy:
            return False
        try:
            await asyncio.wait_for(self.engine.check_health(), timeout=5)
        except Exception as exc:
            self.mark_engine_failed(type(exc).__name__)
            return False
        return True

    def ensure_text_or_video(self, config: SessionConfig) -> None:
        if config.modality == "video" and not self.multimodal:
            raise InvalidEvent(
                f"session.open.modality: {self.model_name!r} takes text only; use 'text'"
            )
        if config.modality == "video" and self.chat.image is None:
            raise InvalidEvent(
                f"session.open.modality: the chat template of {self.model_name!r} writes no "
                "image placeholder, so this server cannot send it frames; use 'text'"
            )
