"""Admission by compute: the engine time a session's frames take, measured. Pure, no I/O.

KV admission (realtime/admission.py) keeps sessions from deadlocking the pool; it does not keep
them fast. Every admitted session offers chunks at its declared pace (`limits.frames_per_s`,
default 1), and each chunk takes engine time: its prefill (the image through the processor
and the vision encoder, then its tokens) and its reply. A session's frame waits for its own prefill and for every decode step of its reply; the steps
are shared with the other sessions decoding at once, but a step does not end sooner for that,
so a frame alone takes `solo = prefill + reply tokens × step`. What the other sessions add is
their marginal cost (their prefills, and their tokens' share of the shared steps): at a load
`ρ` from the others, a frame takes about `solo / (1 − ρ)`. It is answered within its period
`1 / frames_per_s` while `frames_per_s × solo + ρ ≤ 1`. A session is admitted only while, for
every open session and the new one,

    frames_per_s × solo of its chunk  +  sum over the other sessions of frames_per_s × marginal
        ≤  headroom

(`headroom` < 1 keeps the tail inside a camera's period); beyond it, `capacity_exceeded`
names the compute term, and the sessions already admitted keep their latency. Counting only
the marginal cost (the previous rule) admitted 2 cameras on an AVX2 machine whose decode step
is 70 ms, where one already takes 700 ms of its 1 s period and two miss it (issue #48).

The cost of a chunk is measured as the server runs, per chunk kind ("frame": an image or clip;
"text": a text turn), from the replies' own timings (`ChunkTiming`):

* prefill = time to first token − one inter-token step (what the chunk adds to the step that
  prefills it: processor, encoder, prompt tokens);
* step = one inter-token step (a session's own reply waits for each);
* per reply token = the prefill's cost per prompt token, at most one inter-token step (the
  marginal cost a reply token adds to a shared step).

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

DEFAULT_HEADROOM = 0.85
"""Share of a session's period its frame may take, at the load the other sessions add. Fitted
to two measured machines (2 cores each, issue #48 and docs/benchmarks.md, "Camera capacity"):
on the AVX2 one (a frame alone 700 ms, 177 ms marginal) one camera meets a 1 s period and two
miss it (p99 1,412 ms): 2 cameras ask 0.88, refused above 0.85; on the AVX-512 one (337 ms
alone, 52 ms marginal) 12 cameras answered within the second and 13 did not, and 0.85 admits
10. `bench.capacity --box` measures the true capacity and the admitted count on a machine."""


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
    step_ms: float | None = None
    """One decode step (None: `per_token_ms`, as a pinned cost has no step of its own)."""

    def solo_ms(self, reply_tokens: int, prefill_scale: float = 1.0) -> float:
        """What such a chunk takes alone: its prefill, then one whole step per reply token."""
        step = self.per_token_ms if self.step_ms is None else self.step_ms
        return self.prefill_ms * prefill_scale + reply_tokens * step

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
    return ChunkCost(prefill_ms=prefill, per_token_ms=per_token, step_ms=step)


@dataclass
class CostModel:
    """Measured costs per chunk kind: the median of the last `window` uncontended chunks.

    `pinned` costs (an operator's, or a test's) are used as they are and never measured."""

    window: int = 16
    pinned: dict[ChunkKind, ChunkCost] = field(default_factory=dict)
    _samples: dict[ChunkKind, deque[ChunkCost]] = field(default_factory=dict)
    _provisional: set[ChunkKind] = field(default_factory=set)

    def observe(self, kind: ChunkKind, timing: ChunkTiming) -> None:
        cost = measure(timing)
        if cost is None or kind in self.pinned:
            return
        if kind in self._provisional:
            # The first chunk measured alone on a quieter machine replaces a busy calibration.
            self._provisional.discard(kind)
            self._samples.pop(kind, None)
        self._samples.setdefault(kind, deque(maxlen=self.window)).append(cost)

    def forget(self, kind: ChunkKind) -> None:
        """Drop the kind's samples (a calibration about to be taken again)."""
        self._samples.pop(kind, None)
        self._provisional.discard(kind)

    def mark_provisional(self, kind: ChunkKind) -> None:
        """The kind's samples were taken while other processes held the CPU: kept until the
        next measured chunk, which replaces them all."""
        if self._samples.get(kind):
            self._provisional.add(kind)

    def provisional(self, kind: ChunkKind) -> bool:
        return kind in self._provisional

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
            step_ms=statistics.median(
                s.per_token_ms if s.step_ms is None else s.step_ms for s in samples
            ),
        )


@dataclass(frozen=True)
class SessionLoad:
    """What one session asks of the engine: its pace, the marginal cost of one of its chunks
    (what it adds beside others), and what one takes alone (None: the marginal cost)."""

    frames_per_s: float
    chunk_ms: float
    solo_ms: float | None = None

    @property
    def load(self) -> float:
        """Engine-seconds per second the session adds beside others."""
        return self.frames_per_s * self.chunk_ms / 1e3

    @property
    def own_share(self) -> float:
        """Share of its own period one of its frames takes alone."""
        solo = self.chunk_ms if self.solo_ms is None else max(self.solo_ms, self.chunk_ms)
        return self.frames_per_s * solo / 1e3


def period_share(session: SessionLoad, total_load: float) -> float:
    """Share of `session`'s period its frame takes among sessions adding `total_load` (it
    included): its own share alone plus what the others add."""
    return session.own_share + total_load - session.load


def compute_problem(
    open_sessions: Iterable[SessionLoad], new: SessionLoad, headroom: float
) -> str | None:
    """Why the engine's time cannot take `new` beside the open sessions, or None: some session
    (the new one or an open one) would then take more than `headroom` of its period.

    The sessions already open are never refused here: a cost that grew after they were
    admitted (a slower machine) only stops new sessions. With none open a session is always
    admitted: it slows no one, and its chunks (alone on the engine) measure the cost again,
    so a cost measured during a burst of other load cannot lock every session out."""
    loads = list(open_sessions)
    if not loads:
        return None
    total = sum(s.load for s in loads) + new.load
    worst = max([*loads, new], key=lambda s: period_share(s, total))
    share = period_share(worst, total)
    if share <= headroom:
        return None
    held = total - new.load
    whose = "this one's" if worst is new else "an open session's"
    return (
        f"the engine's compute cannot serve another session: the {len(loads)} open sessions "
        f"add {held:.2f} engine-s/s and this one {new.load:.2f} ({new.frames_per_s:g} "
        f"frames/s × {new.chunk_ms:.0f} ms a chunk, measured), so {whose} frames would take "
        f"{share:.2f} of their period ({worst.own_share:.2f} alone), over the headroom "
        f"{headroom:g}; a lower limits.frames_per_s or sampling.max_tokens needs less"
    )


def other_cpu_cores(machine_busy_s: float, ours_s: float, wall_s: float) -> float:
    """Cores other processes kept busy over `wall_s`: the machine's busy CPU seconds (all
    cores, /proc/stat) less the server's own processes'."""
    if wall_s <= 0:
        return 0.0
    return max(machine_busy_s - ours_s, 0.0) / wall_s


BUSY_CORES = 0.5
"""Other processes' use of the CPU above which a calibration is not taken as the machine's:
half a core, on a 2-core machine a quarter of it (a pip install beside the server made a frame
cost 716 ms instead of 139, issue #48)."""
