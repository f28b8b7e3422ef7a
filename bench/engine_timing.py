"""EngineCore-side timers for the benchmarks (loaded in the EngineCore process).

`bench.run` and `bench.watch` start their engines with `scheduler_cls` set to `TimedScheduler`
below (`SCHEDULER_CLS`): the server's own `RealtimeSessionScheduler` with wall-clock timers
around the two places where a chunk is folded into its session (EngineCore's scheduler thread, so
the timers measure exactly the time the scheduler spends there, between engine steps):

* `_update_request_as_session`: vLLM's fold + the streaming guards + retention + the chunk's
  grammar, every session;
* `SessionRetention.after_fold`: retention alone (segment bookkeeping, eviction plan, KV range
  free, request compaction, the consolidation decision). Folds that evicted or consolidated are
  counted apart (the retention history's counters moved during the call).

A consolidation's real cost is the re-prefill of the survivors, which runs on the worker in the
next step. So engine steps are timed too (from `schedule()` to the end of `update_from_output()`:
scheduling, the model run, output handling): for each session, the steps that ran a prefill of
more than one token, with the session's scheduled token count, the step that ran the re-prefill
after a consolidation kept apart; and for every request, the wall time of all the steps that
scheduled it (`busy_ns`, bench.watch). Nothing here changes what the scheduler does. Read the
timers from the front end with `await bench_timing(engine)`; they are keyed by the session's
external request id.

`OldPathTimedScheduler` (`OLD_PATH_SCHEDULER_CLS`) is the same with the chunk-grammar part left
out: the composition the benchmark timed before #38 (`BoundedSessionScheduler`, which had no
grammar part), for `bench.run --compare-old-path`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from retention.vllm_adapter.session_scheduler import RealtimeSessionScheduler

TIMING_METHOD = "vllm_realtime_bench_timing"
BUSY_METHOD = "vllm_realtime_bench_busy"

_FIELDS = (
    "fold_calls",
    "fold_ns",
    "after_fold_calls",
    "after_fold_ns",
    "after_fold_max_ns",
    "evicting_folds",
    "evicting_ns",
    "consolidating_folds",
    "consolidating_ns",
)


def _external(request_id: str) -> str:
    # Internal ids are "<external id>-<8 random chars>" (see retention.vllm_adapter.introspect).
    return request_id.rsplit("-", 1)[0]


def _history_counters(retention: Any, request_id: str) -> tuple[int, int]:
    state = retention.sessions.get(request_id)
    history = getattr(state, "history", None)
    return (
        int(getattr(history, "evictions_total", 0) or 0),
        int(getattr(history, "consolidations_total", 0) or 0),
    )


class TimedScheduler(RealtimeSessionScheduler):
    """The production scheduler with the timers described in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bench_timing: dict[str, dict[str, Any]] = defaultdict(_new_record)
        # External request id -> [ns of every step that scheduled it, steps].
        self.bench_busy: dict[str, list[int]] = {}
        self._bench_step: tuple[int, dict[str, int]] | None = None
        self._bench_consolidated: set[str] = set()
        retention = getattr(self, "retention", None)
        original = getattr(retention, "after_fold", None)
        if original is None:
            return
        timing = self.bench_timing
        consolidated = self._bench_consolidated

        def after_fold(request: Any, *a: Any, **kw: Any) -> Any:
            before = _history_counters(retention, request.request_id)
            start = time.perf_counter_ns()
            try:
                return original(request, *a, **kw)
            finally:
                took = time.perf_counter_ns() - start
                after = _history_counters(retention, request.request_id)
                rec = timing[_external(request.request_id)]
                rec["after_fold_calls"] += 1
                rec["after_fold_ns"] += took
                rec["after_fold_max_ns"] = max(rec["after_fold_max_ns"], took)
                if after[0] > before[0]:
                    rec["evicting_folds"] += 1
                    rec["evicting_ns"] += took
                if after[1] > before[1]:
                    rec["consolidating_folds"] += 1
                    rec["consolidating_ns"] += took
                    consolidated.add(request.request_id)

        retention.after_fold = after_fold

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        start = time.perf_counter_ns()
        try:
            super()._update_request_as_session(session, update)
        finally:
            rec = self.bench_timing[_external(session.request_id)]
            rec["fold_calls"] += 1
            rec["fold_ns"] += time.perf_counter_ns() - start

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        output = super().schedule(*args, **kwargs)
        self._bench_step = (start, dict(output.num_scheduled_tokens))
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        step, self._bench_step = self._bench_step, None
        if step is not None:
            took = time.perf_counter_ns() - step[0]
            total = sum(step[1].values())
            for request_id, tokens in step[1].items():
                busy = self.bench_busy.setdefault(_external(request_id), [0, 0])
                busy[0] += took
                busy[1] += 1
                if tokens <= 1:
                    continue  # a decode step (a fold may happen at its end: not yet ours)
                if request_id in self._bench_consolidated:
                    self._bench_consolidated.discard(request_id)
                    key = "reprefill_steps"
                else:
                    key = "prefill_steps"
                self.bench_timing[_external(request_id)][key].append([took, tokens, total])
        return outputs


def _new_record() -> dict[str, Any]:
    rec: dict[str, Any] = dict.fromkeys(_FIELDS, 0)
    rec["prefill_steps"] = []  # [step ns, this session's tokens, all tokens of the step]
    rec["reprefill_steps"] = []
    return rec


def _bench_timing(core: Any, reset: bool = False) -> dict[str, dict[str, Any]] | None:
    data = getattr(core.scheduler, "bench_timing", None)
    if data is None:
        return None
    out = {key: {k: list(v) if isinstance(v, list) else v for k, v in value.items()}
           for key, value in data.items()}  # fmt: skip
    if reset:
        data.clear()
    return out


class OldPathTimedScheduler(TimedScheduler):
    """`TimedScheduler` without the chunk-grammar part: the benchmark's pre-#38 composition."""

    chunk_grammars = False


def _busy(core: Any) -> dict[str, list[int]]:
    return dict(getattr(core.scheduler, "bench_busy", {}))


def _install() -> None:
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, TIMING_METHOD):
        setattr(EngineCore, TIMING_METHOD, _bench_timing)
    if not hasattr(EngineCore, BUSY_METHOD):
        setattr(EngineCore, BUSY_METHOD, _busy)


_install()  # runs in the EngineCore process when vLLM resolves `scheduler_cls`

SCHEDULER_CLS = f"{__name__}.TimedScheduler"
OLD_PATH_SCHEDULER_CLS = f"{__name__}.OldPathTimedScheduler"


async def bench_timing(engine: Any, reset: bool = False) -> dict[str, dict[str, Any]] | None:
    """From the front end: the timers of every session seen so far (None: not a timed engine)."""
    result: dict[str, dict[str, Any]] | None = await engine.engine_core.call_utility_async(
        TIMING_METHOD, reset
    )
    return result


async def busy_ns(engine: Any, request_id: str) -> int:
    """From the front end: the wall time of every engine step that scheduled `request_id`."""
    data: dict[str, list[int]] = await engine.engine_core.call_utility_async(BUSY_METHOD)
    return int(data.get(request_id, [0, 0])[0])
