"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sessions_open = Gauge(
            "vllm_realtime_sessions_open", "Open sessions.", registry=self.registry
        )
        self.frames = Counter(
            "vllm_realtime_frames", "Chunks answered (response.done sent).", registry=self.registry
        )
        self.frame_latency = Histogram(
            "vllm_realtime_frame_latency_seconds",
            "Per-chunk latency, accepted to response.done.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.kv_blocks_held = Gauge(
            "vllm_realtime_kv_blocks_held", "KV blocks held by sessions.", registry=self.registry
        )
        self.kv_blocks_total = Gauge(
            "vllm_realtime_kv_blocks_total",
            "KV blocks in the engine's pool (usable).",
            registry=self.registry,
        )
        self.kv_blocks_reserved = Gauge(
            "vllm_realtime_kv_blocks_reserved",
            "KV blocks reserved by admission for the open sessions (their peak footprints).",
            registry=self.registry,
        )
        self.kv_pool_bytes = self._kv_pool_gauge()
        self.kv_block_size = Gauge(
            "vllm_realtime_kv_block_size_tokens",
            "Tokens per KV block.",
            registry=self.registry,
        )
        self.default_sessions_fit = Gauge(
            "vllm_realtime_default_sessions_fit",
            "Sessions opened with the defaults (a camera session on a video model, a text "
            "session otherwise) whose admission reservations the KV pool holds at once.",
            registry=self.registry,
        )
        self.engine_errors = Counter(
            "vllm_realtime_engine_errors",
            "Engine failures seen by sessions.",
            registry=self.registry,
        )
        self.sessions_parked = Gauge(
            "vllm_realtime_sessions_parked",
            "Resumable sessions waiting for session.resume (still counted as open).",
            registry=self.registry,
        )
        self.sessions_resumed = Counter(
            "vllm_realtime_sessions_resumed",
            "Successful session.resume.",
            registry=self.registry,
        )
        self.sessions_expired = Counter(
            "vllm_realtime_sessions_expired",
            "Parked sessions closed because nobody resumed them within their grace period.",
            registry=self.registry,
        )
        # The session store (issue #39).
        self.store_bytes_per_fold = Histogram(
            "vllm_realtime_store_bytes_per_fold",
            "Bytes written to the session store per fold of a stored session.",
            buckets=(1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20),
            registry=self.registry,
        )
        self.rebuild_seconds = Histogram(
            "vllm_realtime_session_rebuild_seconds",
            "Rebuilding a session from the store (admission + one re-prefill of its window).",
            registry=self.registry,
        )
        self.rebuild_tokens = Counter(
            "vllm_realtime_session_rebuild_tokens",
            "Tokens re-prefilled to rebuild sessions from the store.",
            registry=self.registry,
        )
        self.errors = Counter(
            "vllm_realtime_protocol_errors", "Error events sent.", ["code"], registry=self.registry
        )

    def _kv_pool_gauge(self) -> Gauge:
        return Gauge(
            "vllm_realtime_kv_pool_bytes",
            "Bytes of the engine's KV pool (the CPU default: what --max-sessions can reserve).",
            registry=self.registry,
        )
