"""Typed records that cross a process boundary of the engine (pure: no vLLM, no torch).

Theory of operation: EngineCore, its worker and the front end are separate processes, and vLLM
gives plugins only loosely typed side channels between them. Each channel here carries exactly
ONE versioned record, built and parsed by this module on both sides, so that a change to the
record is a change to one class and a stale peer fails loudly instead of misreading fields.

* `SessionReport`, EngineCore → front end: what a bounded session, or a streaming session that
  asks for it (`policy.REPORT_KEY`), holds at a chunk boundary (or why the engine ended it). The scheduler sets it in `update_from_output` on the output
  that closes the chunk, so the server learns the session's state from the reply itself,
  without a second call into EngineCore. It rides in `EngineCoreOutput.kv_transfer_params`,
  the one per-output dict vLLM 0.32 passes through to `RequestOutput` untouched (no KV
  connector is ever configured with this scheduler), under `SESSION_REPORT_KEY`. A bounded
  session that asked for it (`policy.SNAPSHOT_KEY`) also gets its `SessionSnapshot` there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

SESSION_REPORT_KEY: Final = "vllm_realtime.session_report"
SESSION_REPORT_VERSION: Final = 1

# Why the engine ended a session (or refused a chunk of one): the wire codes the server maps to
# protocol errors. Defined once, here.
CONTEXT_LENGTH_EXCEEDED: Final = "context_length_exceeded"
LATE_CHUNK_REJECTED: Final = "streaming_chunk_rejected"
RETENTION_UNSUPPORTED: Final = "retention_unsupported"
SessionErrorCode = Literal[
    "context_length_exceeded", "streaming_chunk_rejected", "retention_unsupported"
]
_ERROR_CODES: Final = frozenset(
    {CONTEXT_LENGTH_EXCEEDED, LATE_CHUNK_REJECTED, RETENTION_UNSUPPORTED}
)


class RecordVersionError(ValueError):
    """A record built by a different version of this code (a stale engine or front end)."""


@dataclass(frozen=True, slots=True)
class RetentionCounters:
    """A bounded session's retention bookkeeping at a chunk boundary."""

    chunks_retained: int
    """Whole chunks in the cache, the chunk just answered included."""
    chunks_evicted: int
    """Chunks evicted over the session's life."""
    evictions: int
    """Eviction batches run over the session's life."""
    consolidations: int
    """Re-prefills of the survivors at positions 0..n-1 over the session's life."""
    consolidate_when_idle: bool = False
    """The next chunk (as large as the largest so far) would consolidate on its own path: the
    front end should consolidate now, while the session is idle (a control chunk)."""


SegmentRecord = tuple[int, str, int, bool, bool]
"""One held segment of a snapshot: (chunk index, kind, tokens, pinned, remnant), cache order."""


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """What rebuilds a bounded session elsewhere (issue #39): the tokens it holds at a chunk
    boundary, in cache order, and how they split into history segments, with its counters.

    A fresh request whose prompt is `token_ids` and whose first chunk carries the segments
    (`policy.RESTORE_KEY`) holds exactly what this session holds after a consolidation: the
    same tokens at positions 0..n-1, split into the same segments for eviction."""

    token_ids: list[int]
    """Every token whose KV the session holds (the last sampled token excluded)."""
    segments: list[SegmentRecord]
    """How `token_ids` tile into history segments (their token counts sum to its length)."""
    next_index: int
    """The next chunk number of the history."""
    chunks: int
    """Chunks recorded so far (the first `sink_chunks` are pinned with a text window)."""
    tokens_evicted_total: int = 0
    chunks_evicted_total: int = 0
    evictions_total: int = 0
    consolidations_total: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: Mapping[str, Any], *, check: bool = True) -> SessionSnapshot:
        d = dict(body)
        d["segments"] = [
            (int(i), str(k), int(n), bool(p), bool(r)) for i, k, n, p, r in d["segments"]
        ]
        d["token_ids"] = [int(t) for t in d["token_ids"]]
        snapshot = cls(**d)
        if check and sum(seg[2] for seg in snapshot.segments) != len(snapshot.token_ids):
            raise ValueError("snapshot segments do not tile its tokens")
        return snapshot


@dataclass(frozen=True, slots=True)
class SessionReport:
    """One streaming session's state as EngineCore sees it, on the output that carries it."""

    kv_blocks_held: int
    """KV blocks of the session's block table (null blocks excluded)."""
    tokens_in_context: int
    """Tokens whose KV the session holds: every prompt and reply token but the last sampled
    one (the next fold computes it)."""
    retention: RetentionCounters | None = None
    """Set for a bounded session (one with `streaming_retention`)."""
    error: SessionErrorCode | None = None
    """Set when the engine ended the session (or refused its chunk): why."""
    message: str | None = None
    """The human-readable reason that goes with `error`."""
    snapshot: SessionSnapshot | None = None
    """Set for a bounded session that asked for it: what rebuilds it on another replica."""

    def to_wire(self) -> dict[str, Any]:
        body = asdict(self)
        body["v"] = SESSION_REPORT_VERSION
        return {SESSION_REPORT_KEY: body}

    @classmethod
    def from_wire(cls, params: Mapping[str, Any] | None) -> SessionReport | None:
        """The report in an output's `kv_transfer_params`, or None if it carries none."""
        if not params or SESSION_REPORT_KEY not in params:
            return None
        body = dict(params[SESSION_REPORT_KEY])
        version = body.pop("v", None)
        if version != SESSION_REPORT_VERSION:
            raise RecordVersionError(
                f"session report version {version!r}; this front end reads "
                f"{SESSION_REPORT_VERSION} (engine and server must run the same code)"
            )
        counters = body.pop("retention", None)
        snapshot = body.pop("snapshot", None)
        error = body.get("error")
        if error is not None and error not in _ERROR_CODES:
            raise RecordVersionError(f"unknown session error code {error!r}")
        return cls(
            retention=None if counters is None else RetentionCounters(**counters),
            snapshot=None if snapshot is None else SessionSnapshot.from_dict(snapshot),
            **body,
        )
