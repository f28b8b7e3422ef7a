"""Admission by compute (realtime/compute.py, Admission.check_compute): pure, no engine.

Costs are injected (pinned, or built from given timings): the decision is arithmetic and is
tested as such; that the server measures and applies it is tests/realtime/test_camera_admission.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.admission import Admission, MediaBounds
from realtime.compute import (
    BUSY_CORES,
    ChunkCost,
    ChunkTiming,
    CostModel,
    SessionLoad,
    compute_problem,
    measure,
    other_cpu_cores,
    period_share,
)
from vllm_realtime_protocol import CapacityExceeded, SessionConfig


def test_a_chunk_cost_is_its_prefill_and_its_reply() -> None:
    # ttft 100 ms, 7 steps of 40 ms after it: prefill 100 - 40 = 60 ms; 29 prompt tokens
    # cost 60 / 29 ms each, below a step: a reply token costs that much.
    cost = measure(ChunkTiming(ttft_ms=100, total_ms=380, prompt_tokens=29, completion_tokens=8))
    assert cost is not None
    assert cost.prefill_ms == pytest.approx(60)
    assert cost.per_token_ms == pytest.approx(60 / 29)
    assert cost.chunk_ms(8) == pytest.approx(60 + 8 * 60 / 29)
    # A one-token prompt: a reply token costs at most one whole step.
    one = measure(ChunkTiming(ttft_ms=100, total_ms=380, prompt_tokens=1, completion_tokens=8))
    assert one is not None and one.per_token_ms == pytest.approx(40)
    # One token: no inter-token step, nothing to separate.
    assert measure(ChunkTiming(100, 100, 29, 1)) is None
    assert measure(ChunkTiming(100, 100, 29, 2)) is None  # a zero step: not a measurement


def test_the_cost_model_keeps_the_median_of_recent_chunks_per_kind() -> None:
    costs = CostModel(window=3)
    assert CostModel().window == 16
    assert costs.cost("frame") is None
    for ttft in (100, 500, 120, 110):  # 500: one outlier; the oldest (100) leaves the window
        costs.observe("frame", ChunkTiming(ttft, ttft + 70, 10, 8))
    cost = costs.cost("frame")
    assert cost is not None and cost.prefill_ms == pytest.approx(120 - 10)
    assert costs.samples("frame") == 3 and costs.cost("text") is None
    pinned = CostModel(pinned={"text": ChunkCost(50, 0)})
    pinned.observe("text", ChunkTiming(1000, 2000, 10, 8))
    assert pinned.cost("text") == ChunkCost(50, 0) and pinned.samples("text") == 0


def test_the_refusal_names_the_compute_term() -> None:
    open_sessions = [SessionLoad(1.0, 100.0)] * 5  # 0.5 engine-s/s
    assert compute_problem(open_sessions, SessionLoad(1.0, 100.0), headroom=0.6) is None
    why = compute_problem(open_sessions, SessionLoad(2.0, 100.0), headroom=0.6)
    assert why is not None
    assert "the 5 open sessions add 0.50 engine-s/s and this one 0.20" in why
    assert "would take 0.70 of their period" in why
    assert "2 frames/s × 100 ms a chunk" in why and "headroom 0.6" in why
    assert "limits.frames_per_s" in why
    # Alone, even a session over the headroom is admitted: it slows no one, and its chunks
    # measure the cost again (a cost measured in a burst of other load locks no one out).
    assert compute_problem([], SessionLoad(1.0, 900.0), headroom=0.6) is None


MEDIA = MediaBounds(image_tokens=64, clip_frame_tokens=64, temporal_patch=2)


def rules(headroom: float | None = 0.5) -> Admission:
    return Admission(
        max_model_len=2048,
        max_position=2048,
        block_size=16,
        usable_blocks=10_000,
        max_chunk_tokens=128,
        max_clip_frames=16,
        max_instructions_tokens=512,
        max_sessions=100,
        media=MEDIA,
        compute_headroom=headroom,
    )


def camera(**limits: object) -> SessionConfig:
    return SessionConfig.model_validate(
        {"modality": "video", "sampling": {"max_tokens": 8}, "limits": limits}
    )


def test_admission_counts_each_session_at_its_declared_pace() -> None:
    admission = rules()
    costs = CostModel(pinned={"frame": ChunkCost(90, 1.25), "text": ChunkCost(20, 1.0)})
    # A default camera: 1 frame/s × (90 + 8 × 1.25) ms = 0.1 engine-s/s; 5 fit under 0.5.
    load = admission.session_load(camera(), costs)
    assert load == SessionLoad(1.0, 100.0, 100.0)  # a pinned cost: a step is its marginal cost
    open_configs: list[SessionConfig] = []
    for _ in range(5):
        admission.check_compute(camera(), open_configs, costs)
        open_configs.append(camera())
    with pytest.raises(CapacityExceeded, match="compute"):
        admission.check_compute(camera(), open_configs, costs)
    # A slower camera still fits where a default one does not... after one leaves.
    half = camera(frames_per_s=0.5)
    with pytest.raises(CapacityExceeded):
        admission.check_compute(half, open_configs, costs)
    admission.check_compute(half, open_configs[:-1], costs)
    # A declared 16-frame clip prefills 8 images' tokens: 8 × 90 + 10 ms a chunk.
    assert admission.session_load(camera(max_clip_frames=16), costs) == SessionLoad(
        1.0, 730.0, 730.0
    )
    # Text sessions cost what text chunks cost (64 reply tokens by default).
    text = SessionConfig(modality="text")
    assert admission.session_load(text, costs) == SessionLoad(1.0, 84.0, 84.0)


def test_no_measurement_or_no_headroom_admits_by_kv_only() -> None:
    many = [camera()] * 1000
    rules().check_compute(camera(), many, CostModel())  # nothing measured yet
    pinned = CostModel(pinned={"frame": ChunkCost(90, 1.25)})
    rules(headroom=None).check_compute(camera(), many, pinned)


loads = st.builds(
    SessionLoad,
    frames_per_s=st.floats(0.01, 30, allow_nan=False),
    chunk_ms=st.floats(0, 2000, allow_nan=False),
)


solo_loads = st.builds(
    SessionLoad,
    frames_per_s=st.floats(0.01, 30, allow_nan=False),
    chunk_ms=st.floats(0, 2000, allow_nan=False),
    solo_ms=st.one_of(st.none(), st.floats(0, 4000, allow_nan=False)),
)


@given(st.lists(solo_loads, max_size=40), solo_loads, st.floats(0.05, 1.0))
@settings(max_examples=300, deadline=None)
def test_admitted_sessions_each_fit_the_headroom_of_their_period(
    open_sessions: list[SessionLoad], new: SessionLoad, headroom: float
) -> None:
    """Admitting sessions one by one, from empty: the first is always admitted; beside it, every
    admitted session's frame (alone, plus what the others add) fits the headroom of its period,
    and each refusal is exactly a session that would make one of them pass it."""
    admitted: list[SessionLoad] = []
    for session in [*open_sessions, new]:
        problem = compute_problem(admitted, session, headroom)
        total = sum(s.load for s in admitted) + session.load
        fits = all(period_share(s, total) <= headroom for s in [*admitted, session])
        assert (problem is None) == (not admitted or fits)
        if problem is None:
            admitted.append(session)
    if len(admitted) > 1:
        total = sum(s.load for s in admitted)
        assert all(period_share(s, total) <= headroom + 1e-9 for s in admitted)
        # Without a solo time of their own, this is the old rule: the marginal loads' sum.
        if all(s.solo_ms is None for s in admitted):
            assert total <= headroom + 1e-9


def test_a_frame_alone_counts_whole_steps_and_beside_others_their_marginal_cost() -> None:
    """The AVX2 machine of issue #48: 139 ms prefill, a 70 ms decode step, 4.8 ms marginal per
    reply token, 8 tokens. Alone a frame takes 699 ms of its 1 s period; two take 0.88 each,
    over the default headroom: one camera is admitted, as one is all that machine answers."""
    from realtime.compute import DEFAULT_HEADROOM

    cost = ChunkCost(prefill_ms=139, per_token_ms=4.8, step_ms=70)
    one = SessionLoad(1.0, cost.chunk_ms(8), cost.solo_ms(8))
    assert one.own_share == pytest.approx(0.699)
    assert compute_problem([], one, DEFAULT_HEADROOM) is None
    assert compute_problem([one], one, DEFAULT_HEADROOM) is not None
    # The AVX-512 machine of docs/benchmarks.md (41 ms, 37 ms steps, 1.4 ms): 10 admitted.
    fast = ChunkCost(prefill_ms=41, per_token_ms=1.4, step_ms=37)
    cam = SessionLoad(1.0, fast.chunk_ms(8), fast.solo_ms(8))
    admitted: list[SessionLoad] = []
    while compute_problem(admitted, cam, DEFAULT_HEADROOM) is None:
        admitted.append(cam)
    assert len(admitted) == 10


def test_a_busy_calibration_gives_way_to_the_first_chunk_measured_alone() -> None:
    costs = CostModel()
    for _ in range(4):
        costs.observe("frame", ChunkTiming(700, 900, 40, 8))
    costs.mark_provisional("frame")
    assert costs.provisional("frame") and costs.samples("frame") == 4
    costs.observe("frame", ChunkTiming(150, 640, 40, 8))
    cost = costs.cost("frame")
    assert cost is not None and costs.samples("frame") == 1 and not costs.provisional("frame")
    assert cost.step_ms == pytest.approx(70) and cost.prefill_ms == pytest.approx(80)
    costs.forget("frame")
    assert costs.cost("frame") is None
    # Other processes' cores: the machine's busy seconds less the server's own, per second.
    assert other_cpu_cores(machine_busy_s=6.0, ours_s=2.0, wall_s=4.0) == pytest.approx(1.0)
    assert other_cpu_cores(1.0, 2.0, 4.0) == 0.0 and other_cpu_cores(1.0, 0.0, 0.0) == 0.0
    assert BUSY_CORES == 0.5


@given(
    ttft=st.floats(1, 5000),
    steps=st.lists(st.floats(1, 500), min_size=1, max_size=64),
    prompt=st.integers(1, 4096),
)
@settings(max_examples=300, deadline=None)
def test_a_measured_cost_is_bounded_by_the_chunk_time(
    ttft: float, steps: list[float], prompt: int
) -> None:
    """Whatever the timings: the prefill is at most the time to first token, a reply token at
    most one step, so a chunk never costs more than it took."""
    total = ttft + sum(steps)
    cost = measure(ChunkTiming(ttft, total, prompt, len(steps) + 1))
    assert cost is not None
    step = sum(steps) / len(steps)
    assert 0 <= cost.prefill_ms <= ttft
    assert 0 <= cost.per_token_ms <= step * (1 + 1e-9)
    assert cost.chunk_ms(len(steps) + 1) <= total * (1 + 1e-9) + step
