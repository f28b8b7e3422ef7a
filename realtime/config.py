"""Server configuration: one frozen object passed from the CLI to the app."""

from __future__ import annotations

from dataclasses import dataclass

from realtime.compute import DEFAULT_HEADROOM
from realtime.media import DEFAULT_MAX_FRAME_PIXELS
from retention.policy import CONSOLIDATION_MODES, ConsolidationMode


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # More accepted keys (the CLI's repeated --api-key); each key is its own owner, so sessions
    # of one key are invisible to the others and `max_sessions_per_key` counts per key.
    api_keys: tuple[str, ...] = ()
    max_sessions: int = 32
    # Sessions one API key may hold at once (None: only `max_sessions`); over it session.open
    # gets `capacity_exceeded`. Without an API key every caller shares the anonymous budget.
    max_sessions_per_key: int | None = None
    idle_timeout_s: float = 300.0
    max_frame_bytes: int = 4 << 20
    # Per-connection token bucket on frame.append events (refill rate per second, bucket size);
    # a frame over it gets `rate_limited` and is dropped. Generous by default: a live client
    # is paced by one chunk in flight, far below this.
    max_frames_per_s: float = 100.0
    frame_burst: int = 200
    # Bounded sessions consolidate (re-prefill their window at positions 0..n-1) before their
    # RoPE positions reach this; None: the model's trained range. Lower it for a model that
    # degrades well inside its trained range.
    retention_max_position: int | None = None
    # How bounded sessions consolidate: "rotate" (rotate the window's cached keys to 0..n-1 in
    # place, no model step; 1D-RoPE models on the CPU build), "reprefill" (recompute the
    # window); None: the engine's default (rotate where it can, else reprefill).
    consolidation: ConsolidationMode | None = None
    # Most tokens of one chunk's text (a text turn, or a frame's prompt; the chat template
    # included) and of the instructions: admission reserves a bounded session's footprint from
    # them (realtime/admission.py), so they are enforced (chunk_too_large, invalid_request).
    max_chunk_tokens: int = 128
    max_instructions_tokens: int = 512
    # Most pixels of one image or clip frame (a larger one is resized down to it, the processor
    # is told the same cap); admission reserves a frame's tokens from it. None: no cap (the
    # processor's own max pixels, 12-16 megapixels in published Qwen-VL configs).
    max_frame_pixels: int | None = DEFAULT_MAX_FRAME_PIXELS
    # The chat template to write prompts with (vLLM's --chat-template: a file, or the template
    # itself), instead of the model's own.
    chat_template: str | None = None
    # Refuse (invalid_request) a client's retention budget whose worst case cannot fit, instead
    # of reserving it as a whole context (SessionHub.admit).
    strict_budgets: bool = False
    # Admission by compute (realtime/compute.py): the share of the engine's time the open
    # sessions' declared paces may ask for; None admits by KV and session counts only.
    compute_headroom: float | None = DEFAULT_HEADROOM
    # The cost of every chunk (its prefill, ms; replies free) instead of measuring it: for an
    # operator who measured their own, and for tests (timings are not reproducible).
    chunk_cost_ms: float | None = None
    # On SIGTERM/SIGINT: seconds the replies in flight get to finish before they are cancelled
    # (realtime/drain.py). Keep it under the supervisor's kill timeout (Kubernetes: 30 s).
    drain_timeout_s: float = 20.0
    # Cap on session.open.resumable.grace_s: how long a dropped resumable session is kept
    # (KV and admission reservation included) for session.resume; 0: no session is resumable.
    max_resume_grace_s: float = 60.0
    # The shared session store (redis://HOST:PORT/DB, realtime/session_store.py): resumable
    # bounded text sessions are written there at every fold and any replica can resume them.
    # None: resumable sessions live in this process only.
    session_store: str | None = None
    # The engine died: False exits (ENGINE_DEAD_EXIT_STATUS) once sessions are handed over or
    # closed, so a supervisor restarts the replica; True stays up (503 on /health), as vLLM's
    # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH does.
    keep_alive_on_engine_death: bool = False
    # Browser credentials (POST /v1/realtime/client_secrets): default and longest lifetime.
    client_secret_ttl_s: float = 60.0
    max_client_secret_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.consolidation is not None and self.consolidation not in CONSOLIDATION_MODES:
            raise ValueError(
                f"consolidation must be one of {', '.join(CONSOLIDATION_MODES)} or None, "
                f"got {self.consolidation!r}"
            )
        if self.retention_max_position is not None and self.retention_max_position < 1:
            raise ValueError(
                f"retention_max_position must be >= 1, got {self.retention_max_position}"
            )
        from realtime.client_secrets import SECRET_PREFIX

        if any(k.startswith(SECRET_PREFIX) for k in self.accepted_keys()):
            raise ValueError(f"API keys must not start with {SECRET_PREFIX!r} (client secrets do)")
        if not 0 < self.client_secret_ttl_s <= self.max_client_secret_ttl_s:
            raise ValueError("need 0 < client_secret_ttl_s <= max_client_secret_ttl_s")
        if self.max_frame_pixels is not None and self.max_frame_pixels < 1:
            raise ValueError(f"max_frame_pixels must be >= 1, got {self.max_frame_pixels}")
        if self.max_chunk_tokens < 1 or self.max_instructions_tokens < 1:
            raise ValueError("max_chunk_tokens and max_instructions_tokens must be >= 1")
        if self.max_resume_grace_s < 0:
            raise ValueError(f"max_resume_grace_s must be >= 0, got {self.max_resume_grace_s}")
        if self.compute_headroom is not None and self.compute_headroom <= 0:
            raise ValueError(f"compute_headroom must be > 0, got {self.compute_headroom}")
        if self.chunk_cost_ms is not None and self.chunk_cost_ms < 0:
            raise ValueError(f"chunk_cost_ms must be >= 0, got {self.chunk_cost_ms}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")

    def accepted_keys(self) -> tuple[str, ...]:
        """Every key the server accepts; empty when no key is required."""
        return tuple(k for k in (self.api_key, *self.api_keys) if k)
