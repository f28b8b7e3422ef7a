"""The one record the scheduler sends the worker about a retention session (vLLM 0.32).

At a session's first chunk and at every later fold, the scheduler (``eviction.py``) writes a
:class:`FoldControl` into ``SamplingParams.extra_args[FOLD_CONTROL_KEY]``. vLLM sends each
folded continuation to the worker as a full ``NewRequestData`` with those params, so the worker
sees every fold exactly once and in order; a resumed (preempted) request keeps the worker's own
copy of the params. The record carries everything the worker needs and nothing else:

* ``fold``: the fold's sequence number (0 at the first chunk);
* ``position_offset``: 1D RoPE rotates a token at ``cache index + position_offset``
  (``positions.py``);
* ``held_before``, ``evicted``, ``reset``: the mRoPE position tensor's update (``mrope.py``);
* ``preemptions``: how often the scheduler preempted the session so far; the worker counts the
  resumes it saw (``preemption.py``);
* ``rotations``: a consolidation by rotation (1D RoPE): ``(start, end, delta)`` runs of cache
  indices (after this fold's eviction) whose cached keys move from position ``index - delta``
  to ``index`` (``kv_rotation.py``), before the step that computes the folded chunk.

Both sides check it. The scheduler builds only valid records (checked on construction); the
worker refuses a record of another ``version``, a fold that is not the previous one + 1 (the
first must be a reset), and a preemption count other than the resumes it saw, with
:class:`FoldControlError`: loud, instead of wrong positions. Requests without the key (every
request that did not ask for retention) take none of these paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from retention.vllm_adapter.errors import VLLMAdapterError

FOLD_CONTROL_KEY: Final = "vllm_realtime.fold_control"
FOLD_CONTROL_VERSION: Final = 2
_FOLD_ATTR: Final = "_vllm_realtime_fold"
_RESUMES_ATTR: Final = "_vllm_realtime_resumes"


class FoldControlError(VLLMAdapterError, RuntimeError):
    """The worker's state and the scheduler's fold control disagree, or the record is not one
    this worker can read."""


@dataclass(frozen=True)
class FoldControl:
    """What the worker must do with a retention session's positions at one fold."""

    fold: int
    position_offset: int = 0
    held_before: int = 0
    evicted: tuple[tuple[int, int], ...] = ()
    reset: bool = False
    preemptions: int = 0
    rotations: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.fold < 0 or self.position_offset < 0 or self.preemptions < 0:
            raise FoldControlError(f"negative count in {self}")
        last = 0
        for a, b, delta in self.rotations:
            if not last <= a < b or delta == 0 or a - delta < 0:
                raise FoldControlError(
                    f"rotation runs {self.rotations} are not sorted, disjoint, non-empty runs "
                    "with a non-zero delta and non-negative old positions"
                )
            last = b
        if self.rotations and (self.reset or self.position_offset):
            raise FoldControlError(
                f"{self}: a consolidation by rotation leaves the offset 0 and needs no re-prefill"
            )
        end = 0
        for a, b in self.evicted:
            if not end <= a < b <= self.held_before:
                raise FoldControlError(
                    f"evicted ranges {self.evicted} are not sorted, disjoint parts of "
                    f"[0, {self.held_before})"
                )
            end = b

    @property
    def consolidates(self) -> bool:
        """A re-prefill consolidation: the fold resets the session's positions after its first
        chunk (the worker then releases memory: `heap_trim.release_after_consolidation`)."""
        return self.reset and self.fold > 0

    def to_args(self) -> dict[str, Any]:
        """Plain values only: the params cross a process boundary (msgpack)."""
        return {
            "version": FOLD_CONTROL_VERSION,
            "fold": self.fold,
            "position_offset": self.position_offset,
            "held_before": self.held_before,
            "evicted": [[a, b] for a, b in self.evicted],
            "reset": self.reset,
            "preemptions": self.preemptions,
            "rotations": [[a, b, d] for a, b, d in self.rotations],
        }

    @classmethod
    def from_args(cls, raw: Mapping[str, Any]) -> FoldControl:
        version = raw.get("version") if isinstance(raw, Mapping) else None
        if version != FOLD_CONTROL_VERSION:
            raise FoldControlError(
                f"fold control of version {version!r}; this worker reads version "
                f"{FOLD_CONTROL_VERSION} (scheduler and worker from different builds?)"
            )
        try:
            return cls(
                fold=int(raw["fold"]),
                position_offset=int(raw["position_offset"]),
                held_before=int(raw["held_before"]),
                evicted=tuple((int(a), int(b)) for a, b in raw["evicted"]),
                reset=bool(raw["reset"]),
                preemptions=int(raw["preemptions"]),
                rotations=tuple((int(a), int(b), int(d)) for a, b, d in raw["rotations"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FoldControlError(f"malformed fold control {dict(raw)!r}: {e}") from e


def set_fold_control(sampling_params: Any, control: FoldControl) -> None:
    """Scheduler side: a new extra_args dict, so a copy the worker already holds is untouched."""
    extra = dict(sampling_params.extra_args or {})
    extra[FOLD_CONTROL_KEY] = control.to_args()
    sampling_params.extra_args = extra


def fold_control_of(sampling_params: Any) -> FoldControl | None:
    extra = getattr(sampling_params, "extra_args", None)
    if not extra or FOLD_CONTROL_KEY not in extra:
        return None
    return FoldControl.from_args(extra[FOLD_CONTROL_KEY])


def position_offset_of(sampling_params: Any) -> int:
    """The 1D RoPE offset, read every step: a dict lookup (the record was checked at its fold
    by `accept_fold`)."""
    extra = getattr(sampling_params, "extra_args", None)
    if not extra:
        return 0
    raw = extra.get(FOLD_CONTROL_KEY)
    return int(raw["position_offset"]) if raw else 0


def with_offset_reset(sampling_params: Any) -> bool:
    """A resumed session is recomputed from 0: its offset becomes 0 (worker copy of the params;
    the scheduler's `on_preempted` did the same on its side). False if it has no record."""
    control = fold_control_of(sampling_params)
    if control is None:
        return False
    set_fold_control(sampling_params, replace(control, position_offset=0))
    return True


# --------------------------------------------------------------------------- worker checks


def resumes_seen(req_state: Any) -> int:
    return int(getattr(req_state, _RESUMES_ATTR, 0))


def note_resume(req_state: Any) -> None:
    setattr(req_state, _RESUMES_ATTR, resumes_seen(req_state) + 1)


def accept_fold(req_state: Any, control: FoldControl) -> None:
    """Worker side, once per fold: the record must follow the last one the worker accepted."""
    last: int | None = getattr(req_state, _FOLD_ATTR, None)
    expected = 0 if last is None else last + 1
    if control.fold != expected or (last is None and not control.reset):
        raise FoldControlError(
            f"request {req_state.req_id}: fold {control.fold} received, expected "
            f"{expected}{' (a reset)' if last is None else ''}"
        )
    resumes = resumes_seen(req_state)
    if control.preemptions != resumes:
        raise FoldControlError(
            f"request {req_state.req_id}: the scheduler preempted it {control.preemptions} "
            f"times, the worker saw {resumes} resumes"
        )
    setattr(req_state, _FOLD_ATTR, control.fold)
