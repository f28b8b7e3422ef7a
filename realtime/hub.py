"""The session layer shared by the WebSocket and HTTP adapters: registry, admission, one turn.

Admission control: a session holds KV blocks even while it waits for its next chunk, so sessions
that together need more blocks than the engine has can deadlock it (vllm#49439). Every session
reserves its worst case — ceil(max context / block size) blocks — and is refused at open with
`capacity_exceeded` when the reservations would pass the engine's pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from protocol import (
    CapacityExceeded,
    ContextExceeded,
    EngineError,
    Frame,
    InvalidEvent,
    Limits,
    RealtimeError,
    ResponseDoneEvent,
    ResponseTextDeltaEvent,
    RetentionState,
    SessionConfig,
    SessionProtocol,
    Timing,
    Usage,
)
from realtime import __version__
from realtime.config import ServerConfig
from realtime.engine_session import ChunkDelta, ChunkFinished, EngineSession, render_chunk
from realtime.metrics import Metrics

log = logging.getLogger("vllm_realtime")


@dataclass
class SessionRecord:
    """One open session: its state machine, its engine request, its reservation."""

    protocol: SessionProtocol
    engine_session: EngineSession
    reserved_blocks: int
    owner: str | None  # API key (or None) of whoever opened it; only they may act on it
    last_activity: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Tokens the engine request holds after the last turn, as the engine reports them. For a
    # bounded session this is what the next fold is checked against, not the tokens ever sent.
    tokens_held: int = 0


class SessionHub:
    def __init__(self, engine: Any, config: ServerConfig, model_name: str) -> None:
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.sessions: dict[str, SessionRecord] = {}
        self.metrics = Metrics()
        self.healthy = True
        self.engine_failure: str | None = None
        self.max_model_len = int(engine.model_config.max_model_len)
        self.multimodal = bool(engine.model_config.is_multimodal_model)
        # In-place eviction works for 1D-RoPE and mRoPE models (retention/vllm_adapter/mrope.py).
        self.retention_supported = True
        self.block_size = 16
        self.usable_blocks = 0
        # A paused streaming session still holds one of the engine's `max_num_seqs` request
        # slots (vLLM counts WAITING_FOR_STREAMING_REQ against it). Admitting more sessions than
        # slots starves the extra ones: their first chunk waits until another session closes
        # (found by tests/reliability/test_capacity.py). Admission caps sessions at the slots.
        scheduler_config = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        self.engine_slots: int | None = getattr(scheduler_config, "max_num_seqs", None)

    async def start(self) -> None:
        from retention.vllm_adapter.introspect import kv_stats

        stats = await kv_stats(self.engine)
        self.block_size = int(stats["block_size"] or 16)
        self.usable_blocks = int(stats["num_usable_blocks"])
        if stats["num_kv_cache_groups"] != 1:
            raise RuntimeError(
                "hybrid KV-cache configs (more than one KV-cache group) are not supported"
            )

    def limits(self) -> Limits:
        return Limits(
            max_frame_bytes=self.config.max_frame_bytes,
            max_sessions=self.config.max_sessions,
            idle_timeout_s=self.config.idle_timeout_s,
            max_tokens_cap=min(1024, self.max_model_len // 2),
            max_resume_grace_s=self.config.max_resume_grace_s,
            server_version=__version__,
            model=self.model_name,
        )

    def new_protocol(self) -> SessionProtocol:
        # 128 random bits: a session id is the only thing that names an HTTP session of a server
        # without API keys, so it must not be guessable (protocol.new_session_id gives 96 bits).
        return SessionProtocol(self.limits(), session_id="sess_" + secrets.token_hex(16))

    # -- admission

    def retention_args(self, config: SessionConfig | None) -> dict[str, Any] | None:
        """The engine budget (`extra_args["streaming_retention"]`) of a session, if bounded."""
        if config is None or not self.retention_supported or not config.retention.enabled:
            return None
        r = config.retention
        args: dict[str, Any] = {"sink_tokens": r.sink_tokens, "sink_chunks": r.sink_chunks}
        if r.window_chunks is not None:
            args["window_chunks"] = r.window_chunks
        if r.window_tokens is not None:
            args["window_tokens"] = r.window_tokens
        if self.config.retention_max_position is not None:
            args["max_position"] = self.config.retention_max_position
        return args

    def reservation_blocks(self, config: SessionConfig | None) -> int:
        # A session may grow to max_model_len (unbounded, or a window of chunks whose size the
        # client picks); a token window bounds it tighter. Reserve the worst case.
        tokens = self.max_model_len
        if config is not None and self.retention_args(config) is not None:
            r = config.retention
            if r.window_tokens is not None:
                chunk_cap = self.config.max_frame_bytes  # text: ≤ 1 token per byte
                bound = r.sink_tokens + r.window_tokens + min(chunk_cap, self.max_model_len)
                tokens = min(tokens, bound + config.sampling.max_tokens)
        return math.ceil(tokens / self.block_size) + 1

    def reserved_total(self) -> int:
        return sum(r.reserved_blocks for r in self.sessions.values())

    async def open_session(
        self, protocol: SessionProtocol, config: SessionConfig, owner: str | None
    ) -> SessionRecord:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Ask the engine (a cheap local flag in AsyncLLM), not only the watchdog's last verdict:
        # right after the engine died a session.open must already be refused with engine_error.
        if not await self.check_engine():
            raise EngineError(f"the engine is down: {self.engine_failure}")
        if len(self.sessions) >= self.config.max_sessions:
            raise CapacityExceeded(
                f"{len(self.sessions)} sessions are open; this server runs at most "
                f"{self.config.max_sessions}"
            )
        if self.engine_slots is not None and len(self.sessions) >= self.engine_slots:
            raise CapacityExceeded(
                f"{len(self.sessions)} sessions are open; the engine runs at most "
                f"{self.engine_slots} requests (max_num_seqs)"
            )
        per_key = self.config.max_sessions_per_key
        if per_key is not None:
            mine = sum(1 for r in self.sessions.values() if r.owner == owner)
            if mine >= per_key:
                raise CapacityExceeded(
                    f"this API key holds {mine} sessions; at most {per_key} per key"
                )
        need = self.reservation_blocks(config)
        free = self.usable_blocks - self.reserved_total()
        if need > free:
            raise CapacityExceeded(
                f"the engine's KV cache cannot hold another session: it needs {need} blocks, "
                f"{max(free, 0)} of {self.usable_blocks} are not reserved by open sessions"
            )
        s = config.sampling
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            output_kind=RequestOutputKind.DELTA,
            skip_clone=False,
        )
        retention = self.retention_args(config)
        if retention is not None:
            params.extra_args = {"streaming_retention": retention}
        session = EngineSession(self.engine, protocol.session_id, params)
        record = SessionRecord(protocol, session, need, owner)
        self.sessions[protocol.session_id] = record
        self.metrics.sessions_open.set(len(self.sessions))
        log.info("session opened id=%s modality=%s", protocol.session_id[:12], config.modality)
        return record

    async def close_session(self, record: SessionRecord, *, abort: bool = True) -> None:
        if self.sessions.pop(record.protocol.session_id, None) is None:
            return
        self.metrics.sessions_open.set(len(self.sessions))
        if abort:
            await record.engine_session.abort()
        log.info("session closed id=%s", record.protocol.session_id[:12])

    # -- one turn

    def _estimate_chunk_tokens(self, frame: Frame) -> int:
        # A conservative estimate for the context guard; images/clips of the default model are
        # small. Real guard against overflow sits in the engine layer as well.
        if frame.kind == "text":
            return len((frame.text or "").encode()) // 2 + 16 + len((frame.prompt or "").encode())
        # Clips were estimated at 1024 tokens, so on a 1024-token model every clip was refused
        # with context_exceeded (a 3-frame clip is ~25 tokens on the tiny VLM). The exact check
        # is vLLM's own prompt-length refusal, now reported as context_exceeded too.
        return 256

    async def run_turn(
        self, record: SessionRecord, frame: Frame, *, cancelled: asyncio.Event | None = None
    ) -> AsyncIterator[ResponseTextDeltaEvent | ResponseDoneEvent]:
        """Run one accepted chunk; yield its deltas, then always exactly one response.done."""
        proto = record.protocol
        config = proto.config
        assert config is not None
        es = record.engine_session
        record.last_activity = time.monotonic()
        started = time.perf_counter()
        text_parts: list[str] = []
        status = "completed"
        reason: str | None = None
        usage = Usage()
        timing = Timing()
        raise_after: RealtimeError | None = None
        try:
            held = es.context_tokens if self.retention_args(config) is None else record.tokens_held
            need = held + self._estimate_chunk_tokens(frame) + config.sampling.max_tokens
            if need > self.max_model_len:
                raise ContextExceeded(
                    f"this chunk would take the session to about {need} tokens; the model's "
                    f"context is {self.max_model_len}"
                )
            prompt = await asyncio.to_thread(
                render_chunk, frame, config, first=es.chunks == 0, multimodal=self.multimodal
            )
            queue_ms = (time.perf_counter() - started) * 1e3
            async for item in es.run_chunk(prompt):
                if isinstance(item, ChunkDelta):
                    text_parts.append(item.text)
                    if cancelled is None or not cancelled.is_set():
                        yield ResponseTextDeltaEvent(frame_index=frame.frame_index, delta=item.text)
                elif isinstance(item, ChunkFinished):
                    usage = Usage(
                        prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens
                    )
                    timing = Timing(queue_ms=queue_ms, ttft_ms=item.ttft_ms, total_ms=item.total_ms)
                    if item.finish_reason == "length":
                        status, reason = "incomplete", "max_tokens"
            if cancelled is not None and cancelled.is_set():
                status, reason = "cancelled", "client_cancelled"
        except RealtimeError as exc:
            status, reason = "failed", exc.code
            if isinstance(exc, EngineError):
                self.metrics.engine_errors.inc()
            raise_after = exc
        retention = await self.retention_state(record, usage)
        record.tokens_held = retention.tokens_retained
        total_ms = (time.perf_counter() - started) * 1e3
        if timing.total_ms is None:
            timing = Timing(total_ms=total_ms)
        self.metrics.frames.inc()
        self.metrics.frame_latency.observe(total_ms / 1e3)
        record.last_activity = time.monotonic()
        yield proto.response_finished(
            status,  # type: ignore[arg-type]
            text="".join(text_parts),
            status_reason=reason,
            usage=usage,
            timing=timing,
            retention=retention,
        )
        if raise_after is not None:
            raise raise_after

    async def retention_state(self, record: SessionRecord, last_turn: Usage) -> RetentionState:
        from retention.vllm_adapter.introspect import session_summary

        sid = record.protocol.session_id
        es = record.engine_session
        held = 0
        state: dict[str, Any] | None = None
        with contextlib.suppress(Exception):
            summary = await session_summary(self.engine, sid)
            if summary is not None:
                held = int(summary["kv_blocks_held"])
                state = summary["retention"]
        if state is None:
            return RetentionState(
                frames_retained=es.chunks,
                tokens_retained=es.context_tokens,
                kv_blocks_held=held,
            )
        return RetentionState(
            # The chunk just answered (and its reply) is not a history segment yet: it becomes
            # one at the next fold. It is in the cache all the same, but for the last sampled
            # token, which the next fold computes.
            frames_retained=int(state["chunks_retained"]) + 1,
            frames_evicted=int(state["chunks_evicted"]),
            tokens_retained=int(state["tokens_held"])
            + last_turn.prompt_tokens
            + max(0, last_turn.completion_tokens - 1),
            kv_blocks_held=held,
            consolidations=int(state["consolidations"]),
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
