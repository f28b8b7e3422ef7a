"""mRoPE position bookkeeping (no engine): the worker patch and the scheduler's item compaction.

The key property: after any sequence of folds with in-place evictions, the positions the worker
keeps are exactly the stock positions of the WHOLE uncompacted history (vLLM's own Qwen2-VL
``get_mrope_input_positions`` over every token ever sent), restricted to the tokens held.
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import MethodType, ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from retention.vllm_adapter.eviction import SessionRetention
from retention.vllm_adapter.fold_control import (
    FOLD_CONTROL_KEY,
    FOLD_CONTROL_VERSION,
    FoldControl,
    FoldControlError,
    fold_control_of,
    set_fold_control,
)
from retention.vllm_adapter.mrope import (
    MRopeSyncError,
    _patch_runner,
    appended_positions,
    held_positions,
)

IMAGE_TOKEN = 7
VIDEO_TOKEN, VISION_START, VISION_END = 6, 8, 9


def qwen2_vl_positions() -> Any:
    """vLLM's Qwen2-VL position function, bound to a stub with merge size 2."""
    stub = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    )
    stub.iter_mm_grid_thw = MethodType(Qwen2VLForConditionalGeneration.iter_mm_grid_thw, stub)
    stub.get_mrope_input_positions = MethodType(
        Qwen2VLForConditionalGeneration.get_mrope_input_positions, stub
    )
    return stub


def image_feature(offset: int, h: int, w: int, name: str) -> MultiModalFeatureSpec:
    grid = SimpleNamespace(data=torch.tensor([1, 2 * h, 2 * w]))
    return MultiModalFeatureSpec(
        data={"image_grid_thw": grid},
        modality="image",
        identifier=name,
        mm_position=PlaceholderRange(offset=offset, length=h * w),
    )


def positions_only(model_cls: type, config: Any) -> Any:
    """vLLM's position function of `model_cls`, bound to an uninitialised instance holding only
    a stub config (as the scheduler binds it: mrope.chunk_position_function)."""
    stub = object.__new__(model_cls)
    stub.config = config
    return stub


def qwen3_vl_positions() -> Any:
    return positions_only(
        Qwen3VLForConditionalGeneration,
        SimpleNamespace(
            video_token_id=VIDEO_TOKEN,
            vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
            vision_config=SimpleNamespace(spatial_merge_size=2),
        ),
    )


def qwen2_5_vl_positions() -> Any:
    return positions_only(
        Qwen2_5_VLForConditionalGeneration,
        SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=4)),
    )


FAMILY_POSITIONS = {
    "qwen2-vl": qwen2_vl_positions,
    "qwen2.5-vl": qwen2_5_vl_positions,
    "qwen3-vl": qwen3_vl_positions,
}


def video_feature(
    offset: int, length: int, grid: tuple[int, int, int], name: str, seconds: float | None = None
) -> MultiModalFeatureSpec:
    t, h, w = grid
    data: dict[str, Any] = {"video_grid_thw": SimpleNamespace(data=torch.tensor([t, 2 * h, 2 * w]))}
    if seconds is not None:
        data["second_per_grid_ts"] = SimpleNamespace(data=torch.tensor(seconds))
    return MultiModalFeatureSpec(
        data=data,
        modality="video",
        identifier=name,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


class FakeRunner:
    """The two members of GPUModelRunner the patch touches, with the stock behaviour."""

    def __init__(self, model: Any = None) -> None:
        self.model = model if model is not None else qwen2_vl_positions()

    def get_model(self) -> Any:
        return self.model

    def _init_mrope_positions(self, req_state: Any) -> None:
        req_state.mrope_positions, req_state.mrope_position_delta = (
            self.model.get_mrope_input_positions(req_state.prompt_token_ids, req_state.mm_features)
        )


@pytest.fixture(scope="module")
def runner() -> FakeRunner:
    module = ModuleType("fake_runner_module")
    module.GPUModelRunner = FakeRunner
    _patch_runner(module)
    _patch_runner(module)  # idempotent
    return FakeRunner()


def request_state(tokens: list[int], features: list[Any], fold: FoldControl) -> Any:
    params = SimpleNamespace(extra_args={})
    set_fold_control(params, fold)
    return SimpleNamespace(
        req_id="r",
        prompt_token_ids=tokens,
        mm_features=features,
        sampling_params=params,
        num_computed_tokens=0,
        mrope_positions=None,
        mrope_position_delta=None,
    )


def make_chunk(
    rng: random.Random, start: int, index: int, family: str = "qwen2-vl"
) -> tuple[list[int], list[Any]]:
    """Some text, maybe an image (h×w placeholders) or a clip as the family writes it, more
    text. Qwen2.5-VL clips scale their temporal positions (up to 8 s × 4 per patch); Qwen3-VL
    clips are one ``<timestamp text><|vision_start|>pads<|vision_end|>`` group per patch."""
    tokens = [rng.randrange(10, 50) for _ in range(rng.randint(1, 6))]
    features = []
    if rng.random() < 0.7:
        h, w = rng.randint(1, 4), rng.randint(1, 4)
        offset = start + len(tokens)
        if family != "qwen2-vl" and rng.random() < 0.5:
            t = rng.randint(1, 3)
            if family == "qwen3-vl":
                for _ in range(t):
                    tokens += [rng.randrange(10, 50) for _ in range(rng.randint(1, 3))]
                    tokens += [VISION_START, *[VIDEO_TOKEN] * (h * w), VISION_END]
                length = start + len(tokens) - offset
                features.append(video_feature(offset, length, (t, h, w), f"clip{index}"))
            else:
                seconds = rng.choice([0.5, 1.0, 8.0])
                tokens += [VIDEO_TOKEN] * (t * h * w)
                features.append(
                    video_feature(offset, t * h * w, (t, h, w), f"clip{index}", seconds)
                )
        else:
            features.append(image_feature(offset, h, w, f"img{index}"))
            tokens += [IMAGE_TOKEN] * (h * w)
        tokens += [rng.randrange(10, 50) for _ in range(rng.randint(1, 4))]
    return tokens, features


def test_fold_control_round_trip_and_checks() -> None:
    fold = FoldControl(
        fold=3, position_offset=7, held_before=90, evicted=((10, 42), (50, 60)), preemptions=1
    )
    params = SimpleNamespace(extra_args={"other": 1})
    set_fold_control(params, fold)
    assert fold_control_of(params) == fold and params.extra_args["other"] == 1
    assert fold_control_of(SimpleNamespace(extra_args=None)) is None
    # The scheduler cannot build an invalid record ...
    with pytest.raises(FoldControlError):
        FoldControl(fold=1, held_before=10, evicted=((4, 8), (2, 3)))
    with pytest.raises(FoldControlError):
        FoldControl(fold=1, held_before=10, evicted=((4, 12),))
    with pytest.raises(FoldControlError):
        FoldControl(fold=-1)
    # ... and the worker refuses one of another version, or a malformed one.
    raw = dict(params.extra_args[FOLD_CONTROL_KEY])
    for bad in (
        {**raw, "version": FOLD_CONTROL_VERSION + 1},
        {k: v for k, v in raw.items() if k != "version"},
    ):
        with pytest.raises(FoldControlError, match="version"):
            fold_control_of(SimpleNamespace(extra_args={FOLD_CONTROL_KEY: bad}))
    with pytest.raises(FoldControlError, match="malformed"):
        fold_control_of(SimpleNamespace(extra_args={FOLD_CONTROL_KEY: {**raw, "fold": None}}))


def test_held_positions_adds_decoded_tokens_and_drops_evicted_columns() -> None:
    old = torch.tensor([[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]])
    held = held_positions(old, old_delta=-1, held_before=7, evicted=[(1, 3)])
    # Decoded tokens 5, 6 sit at index + delta = 4, 5 in all three rows.
    assert held.tolist() == [[0, 1, 3, 4, 5], [0, 2, 3, 4, 5], [0, 1, 3, 4, 5]]
    with pytest.raises(MRopeSyncError):
        held_positions(old, -1, held_before=4, evicted=[])
    with pytest.raises(MRopeSyncError):
        held_positions(old, -1, held_before=7, evicted=[(1, 3), (2, 4)])


def test_appended_positions_continue_after_the_max_held_position() -> None:
    held = torch.tensor([[0, 5, 9], [0, 7, 9], [0, 6, 9]])
    chunk = torch.tensor([[0, 1, 1], [0, 1, 2], [0, 1, 2]])
    positions, delta = appended_positions(held, chunk)
    assert positions[:, 3:].tolist() == [[10, 11, 11], [10, 11, 12], [10, 11, 12]]
    assert delta == 13 - 6
    empty, delta0 = appended_positions(torch.zeros((3, 0), dtype=torch.long), chunk)
    assert empty.tolist() == chunk.tolist() and delta0 == 3 - 3


@pytest.mark.parametrize("family", sorted(FAMILY_POSITIONS))
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), folds=st.integers(1, 8), reset_at=st.integers(0, 9))
def test_maintained_positions_equal_stock_positions_of_the_whole_history(
    runner: FakeRunner, family: str, seed: int, folds: int, reset_at: int
) -> None:
    """For each family's own position function (Qwen3-VL: interleaving does not enter the
    positions, its clips' timestamps are text of the chunk; Qwen2.5-VL: scaled clips), a
    chunk computed alone and shifted to (max held + 1) is what the stock computation over
    the whole history gives it."""
    rng = random.Random(seed)
    runner = FakeRunner(FAMILY_POSITIONS[family]())  # the fixture patched the class
    stock = runner.model
    # The whole history (every token ever sent), and which of its indices the cache holds.
    all_tokens, all_features = make_chunk(rng, 0, 0, family)
    held_ids = list(range(len(all_tokens)))
    state = request_state(list(all_tokens), list(all_features), FoldControl(fold=0, reset=True))
    runner._init_mrope_positions(state)
    for k in range(1, folds + 1):
        # The previous chunk decoded a few tokens that vLLM keeps.
        replies = [rng.randrange(10, 50) for _ in range(rng.randint(0, 3))]
        all_tokens += replies
        held_ids += range(len(all_tokens) - len(replies), len(all_tokens))
        held_before = len(held_ids)
        # Evict up to two disjoint ranges of cache indices, never the last chunk's tail.
        evicted: list[tuple[int, int]] = []
        cursor = 0
        for _ in range(rng.randint(0, 2)):
            limit = held_before - len(replies) - 1
            if cursor >= limit:
                break
            a = rng.randrange(cursor, limit)
            b = rng.randrange(a + 1, limit + 1)
            evicted.append((a, b))
            cursor = b + 1
        gone = {i for a, b in evicted for i in range(a, b)}
        held_ids = [t for i, t in enumerate(held_ids) if i not in gone]
        chunk, features = make_chunk(rng, len(all_tokens), k, family)
        all_tokens += chunk
        all_features += features
        new_ids = list(range(len(all_tokens) - len(chunk), len(all_tokens)))
        reset = k == reset_at
        # What the scheduler hands the worker: the compacted prompt, features with compacted
        # offsets, and the fold message.
        index_of = {t: i for i, t in enumerate(held_ids + new_ids)}
        state.prompt_token_ids = [all_tokens[t] for t in held_ids + new_ids]
        state.mm_features = [
            replace(f, mm_position=replace(f.mm_position, offset=index_of[f.mm_position.offset]))
            for f in all_features
            if all(i in index_of for i in range(f.mm_position.offset, _end(f)))
        ]
        state.num_computed_tokens = 0 if reset else len(held_ids)
        set_fold_control(
            state.sampling_params,
            FoldControl(fold=k, held_before=held_before, evicted=tuple(evicted), reset=reset),
        )
        runner._init_mrope_positions(state)
        if reset:
            # A re-prefill of the survivors: stock positions of the compacted prompt.
            expected, delta = stock.get_mrope_input_positions(
                state.prompt_token_ids, state.mm_features
            )
        else:
            expected, delta = _stock_restricted(stock, all_tokens, all_features, held_ids + new_ids)
        assert state.mrope_positions.tolist() == expected.tolist(), (k, evicted)
        assert state.mrope_position_delta == delta
        if reset:
            # From now on the reference is the compacted prompt as a fresh history.
            all_tokens = list(state.prompt_token_ids)
            all_features = list(state.mm_features)
            held_ids = list(range(len(all_tokens)))
        else:
            held_ids = held_ids + new_ids


def _end(f: Any) -> int:
    return int(f.mm_position.offset + f.mm_position.length)


def _stock_restricted(
    stock: Any, tokens: list[int], features: list[Any], ids: list[int]
) -> tuple[Any, int]:
    full, _ = stock.get_mrope_input_positions(tokens, features)
    positions = full[:, ids]
    return positions, int(positions.max()) + 1 - len(ids)


def test_fold_sequence_is_checked(runner: FakeRunner) -> None:
    tokens, features = [11, 12, 13], []
    state = request_state(tokens, features, FoldControl(fold=1, held_before=0))
    with pytest.raises(FoldControlError, match="expected 0"):
        runner._init_mrope_positions(state)  # the first fold must be a reset
    set_fold_control(state.sampling_params, FoldControl(fold=0, reset=True))
    runner._init_mrope_positions(state)
    state.num_computed_tokens = 3
    set_fold_control(state.sampling_params, FoldControl(fold=2, held_before=3))
    with pytest.raises(FoldControlError, match="expected 1"):
        runner._init_mrope_positions(state)  # a fold went missing
    set_fold_control(state.sampling_params, FoldControl(fold=1, held_before=3, evicted=((0, 1),)))
    with pytest.raises(MRopeSyncError, match="computed tokens"):
        runner._init_mrope_positions(state)  # 2 held, scheduler says 3
    # Requests without the key take the stock path.
    plain = SimpleNamespace(
        prompt_token_ids=[1, 2],
        mm_features=[],
        sampling_params=SimpleNamespace(extra_args=None),
        mrope_positions=None,
        mrope_position_delta=None,
    )
    runner._init_mrope_positions(plain)
    assert plain.mrope_positions.tolist() == [[0, 1]] * 3


# --------------------------------------------------------------------------- scheduler side


def _request(features: list[Any]) -> Any:
    n = 200
    request = SimpleNamespace(
        request_id="req",
        _all_token_ids=list(range(n)),
        prompt_token_ids=list(range(n)),
        num_prompt_tokens=n,
        num_computed_tokens=n,
        block_hashes=[b"h"] * (n // 32),
        skip_reading_prefix_cache=False,
        mm_features=features,
    )
    request.get_num_encoder_embeds = lambda i: request.mm_features[i].mm_position.get_num_embeds()
    return request


def test_compaction_drops_freed_items_and_releases_their_encoder_entries() -> None:
    ecm = EncoderCacheManager(cache_size=1000)
    features = [
        image_feature(10, 2, 2, "a"),  # inside [0, 64): freed
        image_feature(62, 2, 2, "b"),  # straddles 64: freed (some placeholders gone)
        image_feature(100, 2, 2, "c"),  # after: kept, offset shifted
        image_feature(140, 2, 2, "a"),  # same content as the first: its entry must stay
    ]
    request = _request(features)
    for i in range(4):
        if not ecm.check_and_update_cache(request, i):
            ecm.allocate(request, i)
    # Computed: vLLM unreferences every item once its placeholders are in the KV cache...
    for i in range(4):
        ecm.free_encoder_input(request, i)
    # ... except the last, still referenced by the request (its index must follow compaction).
    ecm.check_and_update_cache(request, 3)
    retention = SessionRetention(None, 32, 4096, uses_mrope=True, encoder_cache_manager=ecm)
    retention._compact_request(request, 0, 64)
    assert [f.identifier for f in request.mm_features] == ["c", "a"]
    assert [f.mm_position.offset for f in request.mm_features] == [36, 76]
    assert ecm.get_freed_mm_hashes() == ["b"]  # "a" is still held at the new index 1
    assert "b" not in ecm.cached and {"a", "c"} <= set(ecm.cached)
    assert ecm.request_cached_ids["req"] == {1}
    assert ecm.num_free_slots == 1000 - 8 and ecm.num_freeable_slots == 1000 - 4
    assert request.num_computed_tokens == 136 and len(request.prompt_token_ids) == 136


def test_position_excess_is_what_a_scaled_clip_spans_beyond_its_tokens() -> None:
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    from retention.vllm_adapter.mrope import chunk_excess

    # vLLM's Qwen2.5-VL position function on a stub config (what the scheduler binds it to).
    stub = object.__new__(Qwen2_5_VLForConditionalGeneration)
    stub.config = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=4)
    )
    positions = stub.get_mrope_input_positions

    def clip(offset: int, seconds: float) -> MultiModalFeatureSpec:
        data = {
            "video_grid_thw": SimpleNamespace(data=torch.tensor([2, 4, 4])),
            "second_per_grid_ts": SimpleNamespace(data=torch.tensor(seconds)),
        }
        return MultiModalFeatureSpec(
            data=data, modality="video", identifier="v", mm_position=PlaceholderRange(offset, 8)
        )

    tokens = [11, 12, 13] + [IMAGE_TOKEN] * 8 + [14, 15]
    # 8 s per temporal patch × 4 tokens per second: the second patch 32 positions on, so the
    # clip spans 33 positions with its 8 tokens.
    assert chunk_excess(positions, tokens, [clip(3, 8.0)]) == 33 - 8
    full, delta = positions(tokens, [clip(3, 8.0)])
    assert int(full.max()) + 1 == len(tokens) + 25 and delta == 25
    # At 2 fps (1 s per patch) the clip spans 4 positions (its 2×2 grid): no excess.
    assert chunk_excess(positions, tokens, [clip(3, 0.5)]) == 0
    # An image never outgrows its tokens; text alone has no items.
    assert chunk_excess(positions, tokens[:7], [image_feature(3, 2, 2, "i")]) == 0
    assert chunk_excess(positions, [1, 2, 3], []) == 0


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen2.5-vl"])
def test_scheduler_binds_each_family_position_function_without_weights(name: str) -> None:
    from vllm.config import ModelConfig

    from realtime.models import build_model
    from retention.vllm_adapter.mrope import chunk_position_function

    function = chunk_position_function(ModelConfig(model=str(build_model(name)), dtype="float32"))
    positions, delta = function([5, 6, 7], [])
    assert positions.tolist() == [[0, 1, 2]] * 3 and delta == 0
