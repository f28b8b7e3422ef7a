"""Admission by compute: the engine time a session's frames take, measured. Pure, no I/O.

KV admission (realtime/admission.py) keeps sessions from deadlocking the pool; it does not keep
them fast. Every admitted session offers chunks at its declared pace (`limits.frames_per_s`,
default 1), and each chunk takes engine time: its prefill (the image through the processor
and the vision encoder, then its tokens) and its reply. Sessions share the engine's steps, so
a frame's latency grows like `solo / (1 - load)`, where `load` is the engine-seconds per
second the open sessions ask for. A session is admitted only while

    sum over open sessions of  frames_per_s × cost of one of its chunks  ≤  headroom

(`headroom` < 1 keeps the tail inside a camera's period); beyond it, `capacity_exceeded`
names the compute term, and the sessions already admitted keep their latency.

The cost of a chunk is measured as the server runs, per chunk kind ("frame": an image or clip;
"text": a text turn), from the replies' own timings (`ChunkTiming`):

* prefill = time to first token − one inter-token step (what the chunk adds to the step that
  prefills it: processor, encoder, prompt tokens);
* per reply token = the prefill's cost per prompt token, at most one inter-token step.

Decode steps are shared by every session decoding at once, so a whole step is not the marginal
cost of a reply token; the prompt's per-token cost is (the same matmuls per token), and is an
upper bound on a video frame's (its prompt tokens include the vision encoder's work).

Only chunks that had the engine to themselves are measured (no other chunk in flight from
their start to their end): under load a chunk's time to first token is mostly queueing behind
other chunks, which is latency, not cost. Each kind keeps the median of its last `window`
samples, so a machine that gets slower or faster (other tenants) is followed within a few
seconds of chunks alone. The server measures a few chunks of each kind at start-up, before it
admits anyone; a session that finds no other open is always admitted (its chunks measure again).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

ChunkKind = Literal["frame", "text"]

DEFAULT_HEADROOM = 0.5
"""Share of the engine's time admission fills. At load ρ a frame takes about solo / (1 − ρ),
and more in practice: on the quiet 2-core reference machine, sessions admitted up to 0.6 (13
of 20 cameras) took 2.7× a frame's solo time (p50 898 ms against 332 ms) and only 89% of
their offered frames were answered within the second; 10 sessions answered all of theirs with
a p99 of 861 ms. 0.5 stays below that knee (docs/benchmarks.md, "Camera capacity")."""


@dataclass(frozen=True)
class ChunkTiming:
    """One answered chunk's timings, as its response.done reports them."""

    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ChunkCost:
    """What one chunk of a kind costs the engine, in milliseconds."""

    prefill_ms: float
    per_token_ms: float

    def chunk_ms(self, reply_tokens: int, prefill_scale: float = 1.0) -> float:
        """A chunk whose prefill is `prefill_scale` times the measured one (a clip of several
        images) and whose reply is at most `reply_tokens` tokens."""
        return self.prefill_ms * prefill_scale + reply_tokens * self.per_token_ms


def measure(timing: ChunkTiming) -> ChunkCost | None:
    """The cost one chunk shows, or None when its timings cannot separate prefill from reply
    (a reply of one token has no inter-token step)."""
    if timing.completion_tokens < 2 or timing.prompt_tokens < 1:
        return None
    step = (timing.total_ms - timing.ttft_ms) / (timing.completion_tokens - 1)
    if step <= 0:
        return None
    prefill = max(timing.ttft_ms - step, 0.0)
    per_token = min(prefill / timing.prompt_tokens, step)
    return ChunkCost(prefill_ms=prefill, per_token_ms=per_token)


@dataclass
class CostModel:
    """Measured costs per chunk kind: the median of the last `window` uncontended chunks.

    `pinned` costs (an operator's, or a test's) are used as they are and never measured."""

    window: int = 16
    pinned: dict[ChunkKind, ChunkCost] = field(default_factory=dict)
    _samples: dict[ChunkKind, deque[ChunkCost]] = field(default_factory=dict)

    def observe(self, kind: ChunkKind, timing: ChunkTiming) -> None:
        cost = measure(timing)
        if cost is None or kind in self.pinned:
            return
        self._samples.setdefault(kind, deque(maxlen=self.window)).append(cost)

    def samples(self, kind: ChunkKind) -> int:
        return len(self._samples.get(kind, ()))

    def cost(self, kind: ChunkKind) -> ChunkCost | None:
        """The kind's cost now, or None before any chunk of it was measured."""
        if kind in self.pinned:
            return self.pinned[kind]
        samples = self._samples.get(kind)
        if not samples:
            return None
        return ChunkCost(
            prefill_ms=statistics.median(s.prefill_ms for s in samples),
            per_token_ms=statistics.median(s.per_token_ms for s in samples),
        )


@dataclass(frozen=True)
class SessionLoad:
    """What one session asks of the engine: its pace and the cost of one of its chunks."""

    frames_per_s: float
    chunk_ms: float

    @property
    def load(self) -> float:
        """Engine-seconds per second."""
        return self.frames_per_s * self.chunk_ms / 1e3


def compute_problem(
    open_sessions: Iterable[SessionLoad], new: SessionLoad, headroom: float
) -> str | None:
    """Why the engine's time cannot take `new` beside the open sessions, or None.

    The sessions already open are never refused here: a cost that grew after they were
    admitted (a slower machine) only stops new sessions. With none open a session is always
    admitted: it slows no one, and its chunks (alone on the engine) measure the cost again,
    so a cost measured during a burst of other load cannot lock every session out."""
    loads = list(open_sessions)
    held = sum(s.load for s in loads)
    if not loads or held + new.load <= headroom:
        return None
    return (
        f"the engine's compute cannot serve another session: the {len(loads)} open sessions "
        f"take {held:.2f} engine-s/s and this one {new.load:.2f} ({new.frames_per_s:g} "
        f"frames/s × {new.chunk_ms:.0f} ms a chunk, measured), over the headroom "
        f"{headroom:g}; a lower limits.frames_per_s or sampling.max_tokens needs less"
    )
