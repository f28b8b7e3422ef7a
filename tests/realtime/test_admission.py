"""The admission footprint is an upper bound on what a bounded session holds (pure, no engine).

The simulation does what the engine does at each fold (retention/vllm_adapter/eviction.py):
record the previous chunk and its kept reply as a segment, plan and apply the eviction (the
KV layer frees exactly the inward-rounded plan), consolidate when positions would pass the
limit; then the chunk is prefilled and answered. The peak blocks held at any point never
exceed `bounded_footprint(...).blocks`.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from realtime.admission import (
    DEFAULT_MEDIA_BOUNDS,
    Admission,
    ChunkBounds,
    Footprint,
    MediaBounds,
    blocks_for,
    bounded_footprint,
    budget_problem,
    max_image_tokens,
    media_bounds,
    media_bounds_or_default,
    unbounded_footprint,
)
from retention.policy import (
    RetentionBudget,
    SessionHistory,
    append_segment,
    apply_eviction,
    consolidate,
    needs_consolidation,
    plan_eviction,
)
from vllm_realtime_protocol import (
    CapacityExceeded,
    ChunkTooLarge,
    ContextExceeded,
    InvalidRequestError,
    SessionConfig,
)

# Needs no model runner: `make compat` also runs it against every supported vLLM.
pytestmark = pytest.mark.compat


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[int, int]]]:
    block_size = draw(st.sampled_from([16, 32, 128]))
    chunk_cap = draw(st.integers(1, 300))
    reply_cap = draw(st.integers(1, 64))
    instructions = draw(st.integers(0, 200))
    budget: dict[str, int | float | None] = {
        "sink_chunks": draw(st.integers(0, 2)),
        "sink_tokens": draw(st.integers(0, 100)),
        "window_chunks": draw(st.none() | st.integers(1, 8)),
        "window_tokens": None,
        "low_watermark_ratio": draw(st.sampled_from([0.25, 0.5, 0.75, 1.0])),
    }
    if budget["window_chunks"] is None or draw(st.booleans()):
        budget["window_tokens"] = draw(st.integers(1, 1000))
    chunks = draw(
        st.lists(
            # Mostly at the caps: the worst case is what admission must cover.
            st.tuples(
                st.just(chunk_cap) | st.integers(1, chunk_cap),
                st.just(reply_cap) | st.integers(1, reply_cap),
            ),
            min_size=1,
            max_size=60,
        )
    )
    return budget, ChunkBounds(chunk_cap, reply_cap, instructions), block_size, chunks


def simulate_peak(
    budget_args: dict[str, int | float | None],
    bounds: ChunkBounds,
    block_size: int,
    chunks: list[tuple[int, int]],
    max_position: int,
) -> int:
    budget = RetentionBudget(**{k: v for k, v in budget_args.items() if v is not None})  # type: ignore[arg-type]
    history = SessionHistory.for_budget(budget)
    held = 0  # tokens computed (the history plus the last chunk and its kept reply)
    peak = 0
    for i, (chunk, reply) in enumerate(chunks):
        if i == 0:
            chunk += bounds.instructions_tokens
        # The fold: what was computed since the last fold becomes a segment.
        if held > history.num_tokens:
            history = append_segment(history, "chunk", held - history.num_tokens)
        plan = plan_eviction(history, budget, block_size, protected_tail_tokens=0)
        if plan.ranges or plan.dropped_segments:
            history = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
        if needs_consolidation(history, budget, chunk + reply, max_position):
            history = consolidate(history)
        # Prefill the chunk and decode the reply: all of it holds a slot at the end.
        peak = max(peak, history.num_tokens + chunk + reply)
        held = history.num_tokens + chunk + reply - 1  # the last sampled token is not kept
    return blocks_for(peak, block_size)


@settings(max_examples=1500, deadline=None)
@given(scenarios())
def test_reservation_bounds_the_peak(
    scenario: tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[int, int]]],
) -> None:
    budget, bounds, block_size, chunks = scenario
    footprint = bounded_footprint(budget, bounds, block_size)
    peak = simulate_peak(budget, bounds, block_size, chunks, max_position=10**9)
    assert peak <= footprint.blocks, (peak, footprint)


def test_footprint_parts_and_refusal_name_the_numbers() -> None:
    bounds = ChunkBounds(chunk_tokens=37, reply_tokens=8, instructions_tokens=0)
    fp = bounded_footprint({"sink_chunks": 1, "window_chunks": 4}, bounds, block_size=32)
    assert (fp.sinks, fp.window, fp.remnants, fp.chunk, fp.reply) == (45, 180, 62, 37, 8)
    assert fp.tokens == 332 and fp.blocks == math.ceil(332 / 32)
    problem = budget_problem(fp, max_position=150, max_model_len=2048)
    assert problem is not None and "332" in problem and "max_position=150" in problem
    assert budget_problem(fp, max_position=8192, max_model_len=332) is not None
    assert budget_problem(fp, max_position=8192, max_model_len=333) is None


def test_frame_tokens_from_the_processor_config() -> None:
    config = {
        "image_processor": {"patch_size": 14, "merge_size": 2, "size": {"longest_edge": 50176}},
        "video_processor": {
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "size": {"longest_edge": 50176},
        },
    }
    assert max_image_tokens(config) == 64  # 224x224 at most: (224/28)^2
    assert max_image_tokens({}) is None
    bounds = media_bounds(config)
    assert bounds is not None
    # One image, or a clip of at most that many frames (frames pair up in time).
    assert bounds.chunk_tokens(1) == bounds.chunk_tokens(2) == 64
    assert bounds.chunk_tokens(16) == 8 * 64
    assert bounds.clip_tokens(3) == 2 * 64
    assert media_bounds({}) is None


@st.composite
def split_scenarios(
    draw: st.DrawFn,
) -> tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[str, int, int]]]:
    block_size = draw(st.sampled_from([16, 32, 128]))
    chunk_cap = draw(st.integers(1, 300))
    reply_cap = draw(st.integers(1, 64))
    instructions = draw(st.integers(0, 200))
    budget: dict[str, int | float | None] = {
        "sink_chunks": draw(st.integers(0, 2)),
        "sink_tokens": draw(st.integers(0, 100)),
        "window_chunks": draw(st.integers(1, 8)),
        "window_tokens": draw(st.none() | st.integers(1, 1000)),
        "text_window_tokens": draw(st.integers(1, 600)),
        "low_watermark_ratio": draw(st.sampled_from([0.25, 0.5, 0.75, 1.0])),
    }
    chunks = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["frame", "text"]),
                st.just(chunk_cap) | st.integers(1, chunk_cap),
                # 1: an ingested chunk (its one sampled token is dropped at the fold)
                st.just(reply_cap) | st.integers(1, reply_cap) | st.just(1),
            ),
            min_size=1,
            max_size=80,
        )
    )
    return budget, ChunkBounds(chunk_cap, reply_cap, instructions), block_size, chunks


def simulate_split_peak(
    budget_args: dict[str, int | float | None],
    bounds: ChunkBounds,
    block_size: int,
    chunks: list[tuple[str, int, int]],
) -> int:
    """What eviction.py does with a text window: the previous chunk and its kept reply become
    two segments (its kind, "reply"), then the frame round and the text round."""
    from retention.policy import eviction_rounds

    budget = RetentionBudget(**{k: v for k, v in budget_args.items() if v is not None})  # type: ignore[arg-type]
    history = SessionHistory.for_budget(budget)
    held = 0
    peak = 0
    pending: tuple[str, int] | None = None
    for i, (kind, chunk, reply) in enumerate(chunks):
        if i == 0:
            chunk += bounds.instructions_tokens
        if pending is not None and held > history.num_tokens:
            new = held - history.num_tokens
            pinned = i - 1 < budget.sink_chunks
            prompt = max(1, min(pending[1], new))
            history = append_segment(history, pending[0], prompt, pinned=pinned)
            if new > prompt:
                history = append_segment(history, "reply", new - prompt, pinned=pinned)
        for plan_round in eviction_rounds(budget):
            plan = plan_round(history, budget, block_size, 0)
            if plan.ranges or plan.dropped_segments:
                history = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
        peak = max(peak, history.num_tokens + chunk + reply)
        held = history.num_tokens + chunk + reply - 1
        pending = (kind, chunk)
    return blocks_for(peak, block_size)


@settings(max_examples=1500, deadline=None)
@given(split_scenarios())
# Found by hypothesis (session 14): frames answered with 2 tokens keep a 1-token reply each; the
# text window kept the replies, the frames between them could not free a whole block of 16,
# and the text round counted them as freed.
@example(
    (
        {
            "sink_chunks": 0,
            "sink_tokens": 0,
            "window_chunks": 1,
            "window_tokens": None,
            "text_window_tokens": 6,
            "low_watermark_ratio": 1.0,
        },
        ChunkBounds(chunk_tokens=13, reply_tokens=2, instructions_tokens=0),
        16,
        [("frame", 13, 2)] * 7,
    )
)
def test_reservation_bounds_the_peak_with_a_text_window(
    scenario: tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[str, int, int]]],
) -> None:
    budget, bounds, block_size, chunks = scenario
    footprint = bounded_footprint(budget, bounds, block_size)
    peak = simulate_split_peak(budget, bounds, block_size, chunks)
    assert peak <= footprint.blocks, (peak, footprint)


# --------------------------------------------------------------------------- Admission rules

MEDIA = MediaBounds(image_tokens=64, clip_frame_tokens=64, temporal_patch=2)


def rules(**overrides: object) -> Admission:
    """A 2048-token engine with 200 blocks of 16 and the server's default caps."""
    args: dict[str, object] = {
        "max_model_len": 2048,
        "max_position": 2048,
        "block_size": 16,
        "usable_blocks": 200,
        "max_chunk_tokens": 128,
        "max_clip_frames": 16,
        "max_instructions_tokens": 512,
        "max_sessions": 4,
        "media": MEDIA,
    }
    args.update(overrides)
    return Admission(**args)  # type: ignore[arg-type]


def video(**fields: object) -> SessionConfig:
    return SessionConfig.model_validate({"modality": "video", **fields})


def test_retention_args_carry_the_budget_and_the_server_position_limit() -> None:
    config = video(retention={"window_chunks": 3, "text_window_tokens": 40})
    assert rules().retention_args(config) == {
        "sink_tokens": 0,
        "sink_chunks": 1,
        "window_chunks": 3,
        "text_window_tokens": 40,
    }
    assert rules(retention_max_position=500).retention_args(config) == {
        "sink_tokens": 0,
        "sink_chunks": 1,
        "window_chunks": 3,
        "text_window_tokens": 40,
        "max_position": 500,
    }
    assert rules().retention_args(video(retention={"enabled": False})) is None
    assert rules().retention_args(None) is None
    # The server's consolidation mode rides along; the engine parses it (RetentionBudget).
    args = rules(consolidation="reprefill").retention_args(config)
    assert args is not None and args["consolidation"] == "reprefill"
    assert RetentionBudget.from_request_args(args).consolidation == "reprefill"


def test_a_server_config_names_a_known_consolidation_mode() -> None:
    from realtime.config import ServerConfig

    assert ServerConfig(consolidation="rotate").consolidation == "rotate"
    with pytest.raises(ValueError, match="consolidation must be one of"):
        ServerConfig(consolidation="shift")  # type: ignore[arg-type]


def test_session_limits_may_only_lower_the_server_caps() -> None:
    admission = rules()
    config = video(limits={"max_chunk_tokens": 32, "max_clip_frames": 4})
    assert admission.chunk_caps(config) == (32, 4)
    # A session that declares nothing sends single images (a camera's), reserved as such.
    assert admission.chunk_caps(video()) == (128, 1)
    clips = video(limits={"max_clip_frames": 16})
    # A clip of 4 frames is 2 temporal steps of 64 tokens; of 16, 8; an image is 64.
    assert admission.media_tokens(config) == 128 and admission.media_tokens(clips) == 512
    assert admission.media_tokens(video()) == 64
    assert admission.media_tokens(SessionConfig(modality="text")) == 0
    assert admission.chunk_tokens_cap(config) == 32 + 128
    for name in ("max_chunk_tokens", "max_clip_frames"):
        with pytest.raises(InvalidRequestError, match=name):
            admission.admit(video(limits={name: 1000}), instructions_tokens=0)


def test_unbounded_sessions_reserve_the_whole_context() -> None:
    admitted = rules().admit(video(retention={"enabled": False}), instructions_tokens=0)
    assert not admitted.bounded and admitted.whole_context_because is None
    assert admitted.footprint == unbounded_footprint(2048, 16)


def test_a_budget_that_cannot_fit_is_reserved_whole_or_refused_when_strict() -> None:
    # 8 segments of 128 + 512 + 64: too many
    config = video(retention={"window_chunks": 8}, limits={"max_clip_frames": 16})
    admitted = rules().admit(config, instructions_tokens=0)
    assert not admitted.bounded and admitted.footprint == unbounded_footprint(2048, 16)
    assert admitted.whole_context_because is not None
    assert "7070 tokens, more than max_position=2048" in admitted.whole_context_because
    with pytest.raises(InvalidRequestError, match=r"session\.open\.retention"):
        rules(strict_budgets=True).admit(config, instructions_tokens=0)
    # Strict refuses only a budget the client chose; the defaults are still reserved whole.
    assert not rules(strict_budgets=True).admit(video(), instructions_tokens=0).bounded


def test_session_counts_and_the_pool() -> None:
    admission = rules(engine_slots=3, max_sessions_per_key=2)
    admission.check_session_counts(open_sessions=2, owner_sessions=1)
    for open_sessions, owner_sessions, why in ((4, 0, "this server"), (3, 0, "max_num_seqs"),
                                               (1, 2, "per key")):  # fmt: skip
        with pytest.raises(CapacityExceeded, match=why):
            admission.check_session_counts(open_sessions, owner_sessions)
    fp = admission.admit(video(retention={"window_chunks": 1}), instructions_tokens=0).footprint
    admission.check_pool(fp, reserved_blocks=200 - fp.blocks, open_sessions=5)
    with pytest.raises(CapacityExceeded, match=f"needs {fp.blocks} blocks"):
        admission.check_pool(fp, reserved_blocks=201 - fp.blocks, open_sessions=5)
    with pytest.raises(InvalidRequestError, match="at most 512"):
        admission.check_instructions(513)


def test_chunks_over_their_caps_or_the_context_are_refused() -> None:
    admission = rules()
    bounded = video(retention={"window_chunks": 1})
    unbounded = video(retention={"enabled": False}, sampling={"max_tokens": 64})

    def check(config: SessionConfig, text: int, clip: int | None = None, held: int = 0) -> None:
        admission.check_chunk(
            config, text_tokens=text, clip_frames=clip, is_frame=True, held_tokens=held
        )

    clips = video(retention={"window_chunks": 1}, limits={"max_clip_frames": 16})
    check(clips, 128, clip=16, held=10**6)  # a bounded session: the engine checks what it holds
    with pytest.raises(ChunkTooLarge, match="max_chunk_tokens"):
        check(bounded, 129)
    with pytest.raises(ChunkTooLarge, match="declared at most 16"):
        check(clips, 1, clip=17)
    # Undeclared: single images; a 2-frame clip is one temporal step, an image's tokens.
    check(bounded, 1, clip=2)
    with pytest.raises(ChunkTooLarge, match=r"4 frames; this session declared at most 1 \("):
        check(bounded, 1, clip=4)
    # Unbounded: held + text + the largest media (an image: 64) + max_tokens must fit.
    check(unbounded, 128, held=2048 - 128 - 64 - 64)
    with pytest.raises(ContextExceeded, match="about 2049 tokens"):
        check(unbounded, 128, held=2048 - 128 - 64 - 64 + 1)


def test_frame_tokens_of_a_splitting_processor() -> None:
    """SmolVLM/Idefics3: tiles with their row/column tokens, newlines and the global image."""
    from realtime.admission import split_image_tokens

    tiny = {
        "image_processor": {
            "do_image_splitting": True,
            "size": {"longest_edge": 64},
            "max_image_size": {"longest_edge": 32},
        },
        "image_seq_len": 4,
    }
    # tiny-smolvlm: 4 tiles x (fake + row + 4) + 2 row newlines + 1 + fake, global, 4, fake.
    assert split_image_tokens(tiny) == 34
    assert media_bounds(tiny) == MediaBounds(34, 0)  # no clips: vLLM serves SmolVLM images only
    unsplit = {"image_processor": {**tiny["image_processor"], "do_image_splitting": False}}
    assert split_image_tokens({**unsplit, "image_seq_len": 4}) == 7  # the global image alone
    # SmolVLM-256M's own sizes: 4 x 4 tiles of 512 px, 64 tokens each.
    real = {
        "image_processor": {
            "do_image_splitting": True,
            "size": {"longest_edge": 2048},
            "max_image_size": {"longest_edge": 512},
        },
        "image_seq_len": 64,
    }
    assert split_image_tokens(real) == 16 * 66 + 4 + 1 + 67
    assert split_image_tokens({"image_processor": {"patch_size": 14}}) is None


def test_media_bounds_default_when_the_processor_says_nothing() -> None:
    assert media_bounds_or_default({}) == DEFAULT_MEDIA_BOUNDS
    # preprocessor_config.json is flat: one set of sizes for images and clips.
    flat = {"patch_size": 14, "merge_size": 2, "max_pixels": 50176, "temporal_patch_size": 2}
    assert media_bounds_or_default(flat) == MediaBounds(64, 64, temporal_patch=2)


@given(
    window_chunks=st.integers(1, 12),
    max_tokens=st.integers(1, 256),
    chunk_cap=st.integers(1, 128),
    clip_cap=st.integers(1, 16),
    instructions=st.integers(0, 512),
    block_size=st.sampled_from([16, 32, 128]),
    max_model_len=st.sampled_from([1024, 2048, 8192]),
)
@settings(max_examples=200, deadline=None)
def test_admitted_reservations_fit_the_context_and_grow_with_the_window(
    window_chunks: int,
    max_tokens: int,
    chunk_cap: int,
    clip_cap: int,
    instructions: int,
    block_size: int,
    max_model_len: int,
) -> None:
    admission = rules(block_size=block_size, max_model_len=max_model_len, max_position=4096)
    whole = unbounded_footprint(max_model_len, block_size)

    def admit(window: int) -> tuple[int, bool]:
        config = video(
            retention={"window_chunks": window},
            sampling={"max_tokens": max_tokens},
            limits={"max_chunk_tokens": chunk_cap, "max_clip_frames": clip_cap},
        )
        admitted = admission.admit(config, instructions_tokens=instructions)
        fp = admitted.footprint
        if admitted.bounded:
            # A bounded reservation fits under both limits and is its own footprint.
            assert fp.tokens < max_model_len and fp.tokens <= 4096
            assert fp == admission.footprint(config, instructions_tokens=instructions)
            assert fp.blocks == blocks_for(fp.tokens, block_size) <= whole.blocks
        else:
            assert fp == whole and admitted.whole_context_because is not None
        return fp.blocks, admitted.bounded

    blocks, bounded = admit(window_chunks)
    wider, wider_bounded = admit(window_chunks + 1)
    if bounded and wider_bounded:
        assert wider > blocks or wider == blocks
    if not bounded:
        assert not wider_bounded  # a wider window never fits where a narrower one did not


def test_the_server_config_sets_the_caps() -> None:
    from realtime.config import ServerConfig

    server = ServerConfig(
        max_chunk_tokens=64, max_sessions=3, retention_max_position=900, strict_budgets=True
    )
    admission = Admission.for_server(
        server,
        max_model_len=1024,
        max_position=900,
        block_size=16,
        usable_blocks=50,
        media=None,
        engine_slots=8,
    )
    assert admission.chunk_caps(video()) == (64, 1)
    assert admission.max_clip_frames == 16  # what a session may declare
    assert admission.retention_args(video())["max_position"] == 900  # type: ignore[index]
    assert (admission.max_sessions, admission.strict_budgets, admission.engine_slots) == (
        3,
        True,
        8,
    )


def test_a_whole_context_reservation_says_so_instead_of_a_sum_of_zeros() -> None:
    assert unbounded_footprint(2048, 32).describe() == (
        "the whole context, 2048 tokens: no retention bounds it"
    )
    bounded = Footprint(tokens=100, blocks=4, sinks=10, window=60, remnants=5, chunk=20, reply=5)
    assert (
        bounded.describe() == "sinks 10 + window 60 + remnants 5 + chunk 20 + reply 5 = 100 tokens"
    )
