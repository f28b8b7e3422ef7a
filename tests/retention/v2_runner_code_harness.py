"""Our V2 hooks executed over the installed vLLM's own V2 runner code, without a model forward.

Run as a child process by tests/retention/test_v2_hooks_on_runner_code.py (marker `compat`):
``python -m tests.retention.v2_runner_code_harness OUT.json``, with PyPI's Triton, the stand-in
`cpu` backend and ``TRITON_INTERPRET=1`` on its environment (tests/model_runner_mode.py
``v2_env``) and, under `make compat`, a later vLLM's unpacked package ahead on ``PYTHONPATH``.
Its own process because vLLM decides about Triton once per process, at import.

The runner is our worker's class (``_runner_over`` vLLM's ``GPUModelRunner``) with vLLM's real
parts in it: ``RequestState``, ``BlockTables``, ``DefaultModelState`` with a ``RopeState``,
``EncoderCache``, ``LoraState``. Only ``__init__`` is skipped (it loads a model and sizes the KV
cache); every method the hooks override runs vLLM's own code, and vLLM's Triton kernels
(``prepare_pos_seq_lens``, ``gather_block_tables``, ``compute_slot_mappings``,
``prepare_positions``) run in the interpreter. The CPU preparation is vLLM's own
(``vllm.v1.worker.cpu.shm``, which its CPU worker imports first).

The mRoPE oracle is independent of ``mrope.py``: the model's own position function over the
whole uncompacted history, with the evicted columns dropped.

Each scenario prints nothing and returns normally, or raises; the result file maps each
scenario's name to "ok" or its traceback.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Final

import vllm.v1.worker.cpu.shm  # noqa: F401  # isort: skip  (vLLM's CPU set-up, as its worker)
import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu import model_runner as runner_module
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
from vllm.v1.worker.gpu.mm.rope import RopeState
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.states import RequestState

from retention.vllm_adapter.fold_control import FOLD_CONTROL_KEY, FoldControl, FoldControlError
from retention.vllm_adapter.v2.worker import RetentionRunnerMixin, _runner_over

CPU: Final = torch.device("cpu")
BLOCK_SIZE: Final = 16
MAX_REQS: Final = 4
MAX_LEN: Final = 128
MAX_BLOCKS: Final = MAX_LEN // BLOCK_SIZE
VOCAB: Final = 1000
IMAGE_TOKEN: Final = 7
SESSION: Final = "cam-0a1b2c3d"
PLAIN: Final = "plain-9f8e7d6c"

# The runner parts a streaming runner without speculation, pooling, pipeline or context
# parallelism has none of (vLLM sets them to None in that case too).
_ABSENT_PARTS: Final = (
    "adaptive_verification",
    "speculator",
    "pooling_runner",
    "pp_handler",
    "prompt_logprobs_worker",
    "sampler",
    "pcp_manager",
    "kv_block_zeroer",
)


def _qwen2_vl_positions_model() -> Any:
    """vLLM's Qwen2-VL class holding only the config its position function reads."""
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    model = object.__new__(Qwen2VLForConditionalGeneration)
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    object.__setattr__(model, "config", config)
    return model


def build_runner(mrope: bool) -> Any:
    """Our runner class over vLLM's, holding vLLM's own request, block-table and model state."""
    runner_cls = _runner_over(runner_module.GPUModelRunner)
    runner: Any = object.__new__(runner_cls)
    runner.device = CPU
    runner.is_last_pp_rank = False  # no sampler: nothing here samples
    for name in _ABSENT_PARTS:
        setattr(runner, name, None)
    if hasattr(runner_module, "DraftTokensHandler"):
        runner.draft_tokens_handler = runner_module.DraftTokensHandler(CPU)
    runner.lora_state = runner_module.LoraState(max_num_reqs=MAX_REQS)
    runner.req_states = RequestState(
        max_num_reqs=MAX_REQS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=MAX_LEN,
        num_speculative_steps=0,
        vocab_size=VOCAB,
        device=CPU,
    )
    runner.block_tables = BlockTables(
        block_sizes=[BLOCK_SIZE],
        max_num_reqs=MAX_REQS,
        max_num_batched_tokens=MAX_LEN,
        max_num_blocks_per_group=[MAX_BLOCKS],
        device=CPU,
    )
    runner.encoder_cache = EncoderCache() if mrope else None
    runner.model = _qwen2_vl_positions_model() if mrope else None
    model_state: Any = object.__new__(DefaultModelState)
    model_state.model = runner.model
    model_state.prompt_embeds_state = None
    model_state.rope_state = (
        RopeState(
            num_dims=3,
            max_num_reqs=MAX_REQS,
            max_num_tokens=MAX_LEN,
            max_model_len=MAX_LEN,
            device=CPU,
        )
        if mrope
        else None
    )
    runner.model_state = model_state
    runner.positions_buffer = torch.zeros(MAX_LEN + 8, dtype=torch.int64)
    runner.seq_lens_buffer = torch.zeros(MAX_REQS + 1, dtype=torch.int32)
    assert isinstance(runner, RetentionRunnerMixin)
    return runner


def sampling(control: FoldControl | None) -> SamplingParams:
    extra = None if control is None else {FOLD_CONTROL_KEY: control.to_args()}
    return SamplingParams(max_tokens=4, extra_args=extra)


def new_request(
    req_id: str,
    tokens: list[int],
    computed: int,
    blocks: list[int],
    control: FoldControl | None,
    features: list[Any] | None = None,
) -> Any:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(tokens),
        mm_features=list(features or []),
        sampling_params=sampling(control),
        pooling_params=None,
        block_ids=(list(blocks),),
        num_computed_tokens=computed,
        lora_request=None,
        prefill_token_ids=list(tokens),
    )


def step(
    runner: Any,
    new: list[Any],
    finished: tuple[str, ...] = (),
    preempted: tuple[str, ...] = (),
    free_hashes: tuple[str, ...] = (),
) -> None:
    """What ``execute_model`` calls before the forward, in its order."""
    out = SimpleNamespace(
        scheduled_new_reqs=new,
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        free_encoder_mm_hashes=list(free_hashes),
    )
    runner.finish_requests(out)
    runner.free_states(out)
    runner.add_requests(out)
    # execute_model applies the block tables' staged rows after adding and updating requests.
    runner.block_tables.apply_staged_writes()


def set_computed(runner: Any, req_id: str, computed: int) -> None:
    """The scheduler's count after a step (vLLM's ``update_requests`` writes it the same way)."""
    idx = runner.req_states.req_id_to_index[req_id]
    runner.req_states.num_computed_tokens_np[idx] = computed
    runner.req_states.num_computed_tokens.stage_write_elem(idx, computed)
    runner.req_states.num_computed_tokens.apply_write()


def attention_inputs(runner: Any, schedule: list[tuple[str, int]]) -> tuple[Any, Any]:
    """A batch of (request, scheduled tokens): vLLM's kernel writes the positions
    (computed + i), then the runner's ``prepare_attn`` (ours over vLLM's) runs. Returns the
    batch (its positions after our offsets) and the slot mappings of group 0."""
    req_ids = [rid for rid, _ in schedule]
    counts = torch.tensor([n for _, n in schedule], dtype=torch.int32)
    idx = torch.tensor([runner.req_states.req_id_to_index[r] for r in req_ids], dtype=torch.int64)
    query_start_loc = torch.zeros(len(req_ids) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(counts, 0)
    num_tokens = int(counts.sum())
    runner_module.prepare_pos_seq_lens(
        idx,
        query_start_loc,
        runner.req_states.num_computed_tokens.gpu,
        runner.positions_buffer,
        runner.seq_lens_buffer,
    )
    batch = SimpleNamespace(
        req_ids=req_ids,
        num_reqs=len(req_ids),
        num_reqs_after_padding=len(req_ids),
        idx_mapping=idx,
        idx_mapping_np=idx.numpy(),
        query_start_loc=query_start_loc,
        num_scheduled_tokens=counts.numpy(),
        num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens,
        positions=runner.positions_buffer[:num_tokens],
    )
    _, slot_mappings = runner.prepare_attn(batch)
    return batch, slot_mappings[0][:num_tokens].tolist()


def expected_slots(blocks: list[int], cache_indices: range) -> list[int]:
    return [blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in cache_indices]


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def expect_refusal(action: Callable[[], None], match: str) -> None:
    try:
        action()
    except FoldControlError as error:
        check(match in str(error), f"refused for another reason: {error}")
        return
    raise AssertionError(f"not refused (expected: {match})")


# --------------------------------------------------------------------------- 1D


def positions_1d_after_eviction_and_slot_mappings() -> None:
    runner = build_runner(mrope=False)
    prompt = list(range(100, 120))  # 20 tokens, cache indices 0..19
    step(
        runner,
        [
            new_request(SESSION, prompt, 0, [5, 9], FoldControl(fold=0, reset=True)),
            new_request(PLAIN, [1, 2, 3], 0, [2], None),
        ],
    )
    batch, slots = attention_inputs(runner, [(SESSION, 20), (PLAIN, 3)])
    check(batch.positions.tolist() == [*range(20), 0, 1, 2], f"fold 0: {batch.positions}")
    check(slots == expected_slots([5, 9], range(20)) + expected_slots([2], range(3)), "slots 0")
    # The chunk was answered with 2 tokens: 22 held. Fold 1 evicts [4, 12): 14 held (cache
    # indices 0..13, true positions 0..3 and 12..21); the chunk's 6 tokens follow at cache index
    # 14, true position 22. The compacted history fits 2 blocks again (the second one new).
    held = prompt[:4] + prompt[12:] + [900, 901]
    chunk = [300, 301, 302, 303, 304, 305]
    fold1 = FoldControl(fold=1, position_offset=8, held_before=22, evicted=((4, 12),))
    set_computed(runner, PLAIN, 3)
    step(runner, [new_request(SESSION, held + chunk, 14, [5, 11], fold1)])
    batch, slots = attention_inputs(runner, [(PLAIN, 1), (SESSION, 6)])
    # The plain request keeps vLLM's positions; the session's move by 8, after the slot
    # mappings were computed from the cache indices 14..19 over the compacted block table.
    check(batch.positions.tolist() == [3, *range(22, 28)], f"fold 1: {batch.positions}")
    check(
        slots == expected_slots([2], range(3, 4)) + expected_slots([5, 11], range(14, 20)),
        f"slots after eviction: {slots}",
    )
    check(
        runner.realtime_session_view("cam")
        == {"position_offset": 8, "folds": [0, 1], "resumes": 0},
        "session view",
    )


def fold_and_preempted_request_arrive_as_new() -> None:
    runner = build_runner(mrope=False)
    prompt = list(range(100, 120))
    step(runner, [new_request(SESSION, prompt, 0, [5, 9], FoldControl(fold=0, reset=True))])
    set_computed(runner, SESSION, 20)
    # The fold arrives as a new request: vLLM removes the old state and adds it again.
    fold1 = FoldControl(fold=1, position_offset=8, held_before=22, evicted=((4, 12),))
    history = prompt[:4] + prompt[12:] + [900, 901] + [300, 301]
    step(runner, [new_request(SESSION, history, 14, [5, 11], fold1)])
    check(runner.req_states.num_reqs == 1, "the fold replaced the request's state")
    idx = runner.req_states.req_id_to_index[SESSION]
    check(int(runner.req_states.num_computed_tokens_np[idx]) == 14, "computed count of the fold")
    check(int(runner.req_states.prefill_len.np[idx]) == 16, "prefill length of the fold")
    set_computed(runner, SESSION, 16)
    # Preempted: removed like a finished request, our record kept.
    step(runner, [], preempted=(SESSION,))
    check(runner.req_states.num_reqs == 0, "vLLM removed the preempted request")
    check(SESSION in runner._realtime_state(), "our record kept across the preemption")
    # Back as a new request with the last fold's record, offset 0 (the scheduler's), all of
    # its 16 tokens recomputed from cache index 0 into new blocks.
    resume = FoldControl(fold=1, held_before=22, evicted=((4, 12),))
    step(runner, [new_request(SESSION, history, 0, [3], resume)])
    batch, slots = attention_inputs(runner, [(SESSION, 16)])
    check(batch.positions.tolist() == list(range(16)), f"resume: {batch.positions}")
    check(slots == expected_slots([3], range(16)), f"resume slots: {slots}")
    check(
        runner.realtime_session_view("cam")
        == {"position_offset": 0, "folds": [0, 1], "resumes": 1},
        "resume counted",
    )
    set_computed(runner, SESSION, 16)
    # The next fold must report the preemption.
    stale = FoldControl(fold=2, held_before=18)
    expect_refusal(
        lambda: step(runner, [new_request(SESSION, [*history, 1, 2], 18, [3], stale)]),
        "preempted it 0 times, the worker saw 1",
    )
    runner = build_runner(mrope=False)
    step(runner, [new_request(SESSION, prompt, 0, [5, 9], FoldControl(fold=0, reset=True))])
    step(runner, [new_request(SESSION, history, 14, [5, 11], fold1)])
    step(runner, [], preempted=(SESSION,))
    step(runner, [new_request(SESSION, history, 0, [3], resume)])
    fold2 = FoldControl(fold=2, held_before=18, preemptions=1)
    step(runner, [new_request(SESSION, [*history, 1, 2, 3], 18, [3, 4], fold2)])
    batch, _ = attention_inputs(runner, [(SESSION, 1)])
    check(batch.positions.tolist() == [18], f"after the resume: {batch.positions}")
    # Finished: vLLM forgets the request, and so do we.
    step(runner, [], finished=(SESSION,))
    check(runner._realtime_state() == {} and runner.req_states.num_reqs == 0, "finished")


# --------------------------------------------------------------------------- mRoPE


def image(hash_: str, offset: int) -> Any:
    """A 112 x 112 Qwen2-VL image: grid 1 x 4 x 4 patches, 4 tokens after the 2 x 2 merge."""
    return MultiModalFeatureSpec(
        data={"image_grid_thw": SimpleNamespace(data=torch.tensor([1, 4, 4]))},  # type: ignore[arg-type]
        modality="image",
        identifier=hash_,
        mm_position=PlaceholderRange(offset=offset, length=4),
        mm_hash=hash_,
    )


def _dense(model: Any, tokens: list[int], features: list[Any]) -> tuple[torch.Tensor, int]:
    positions, delta = model.get_mrope_input_positions(tokens, features)
    return positions.to(torch.int64), int(delta)


def _rows(runner: Any, req_id: str, length: int) -> torch.Tensor:
    rope = runner.model_state.rope_state
    idx = runner.req_states.req_id_to_index[req_id]
    return rope.read_prefill_positions(idx, length).to(torch.int64).clone()


def _scheduled_positions(runner: Any, req_id: str, count: int) -> torch.Tensor:
    """vLLM's kernel reads the rows for the scheduled tokens (``prepare_positions``)."""
    rope = runner.model_state.rope_state
    idx = torch.tensor([runner.req_states.req_id_to_index[req_id]], dtype=torch.int64)
    query_start_loc = torch.tensor([0, count], dtype=torch.int32)
    rope.prepare_positions(
        idx,
        query_start_loc,
        runner.req_states.prefill_len.gpu,
        runner.req_states.num_computed_tokens.gpu,
    )
    return rope.get_positions(count).clone()


IMG = [IMAGE_TOKEN] * 4
FIRST = [10, 11, 12, *IMG, 13, 14, *IMG, 15, 16]  # A at 3, B at 9: 15 tokens
DECODED = [20, 21]
CHUNK = [30, *IMG, 31, 32]  # C at 1 of the chunk: 7 tokens


def _session_through_fold_1(runner: Any) -> tuple[list[int], list[Any]]:
    step(
        runner,
        [
            new_request(
                SESSION,
                FIRST,
                0,
                [4],
                FoldControl(fold=0, reset=True),
                [image("A", 3), image("B", 9)],
            )
        ],
    )
    set_computed(runner, SESSION, 15)
    # Fold 1: image A ([3, 7)) evicted from the 17 held; 13 held, the chunk's 7 follow.
    compacted = FIRST[:3] + FIRST[7:] + DECODED + CHUNK
    features = [image("B", 5), image("C", 14)]
    fold1 = FoldControl(fold=1, held_before=17, evicted=((3, 7),))
    step(runner, [new_request(SESSION, compacted, 13, [4, 6], fold1, features)], free_hashes=("A",))
    return compacted, features


def mrope_rows_after_eviction_and_compaction() -> None:
    runner = build_runner(mrope=True)
    model = runner.model
    step(
        runner,
        [
            new_request(
                SESSION,
                FIRST,
                0,
                [4],
                FoldControl(fold=0, reset=True),
                [image("A", 3), image("B", 9)],
            )
        ],
    )
    dense_first, delta_first = _dense(model, FIRST, [image("A", 3), image("B", 9)])
    check(torch.equal(_rows(runner, SESSION, 15), dense_first), "fold 0 rows are vLLM's")
    check(torch.equal(_scheduled_positions(runner, SESSION, 15), dense_first), "fold 0 kernel")
    set_computed(runner, SESSION, 15)
    compacted, features = _session_through_fold_1(build_runner(mrope=True))
    runner = build_runner(mrope=True)
    compacted, features = _session_through_fold_1(runner)
    # The oracle: the whole history uncompacted (A still there), its evicted columns dropped.
    full = FIRST + DECODED + CHUNK
    dense, _ = _dense(model, full, [image("A", 3), image("B", 9), image("C", 18)])
    keep = [i for i in range(len(full)) if not 3 <= i < 7]
    expected = dense[:, keep]
    rows = _rows(runner, SESSION, len(compacted))
    check(torch.equal(rows, expected), f"rows after eviction:\n{rows}\nexpected\n{expected}")
    # vLLM alone would have laid out the compacted prompt without the gap.
    gapless, _ = _dense(model, compacted, features)
    check(not torch.equal(gapless, expected), "the eviction left no gap to keep")
    # The chunk's 7 scheduled tokens, as vLLM's kernel hands them to the model.
    scheduled = _scheduled_positions(runner, SESSION, 7)
    check(torch.equal(scheduled, expected[:, 13:]), f"scheduled chunk positions: {scheduled}")
    # Decode continues past the top position (the delta follows the compacted index).
    set_computed(runner, SESSION, len(compacted))
    top = int(expected.max()) + 1
    decode = _scheduled_positions(runner, SESSION, 1)
    check(decode.flatten().tolist() == [top] * 3, f"decode position {decode}, expected {top}")
    check(delta_first == int(dense_first.max()) + 1 - 15, "fold 0 delta")


def mrope_reset_and_resume_keep_vllms_rows() -> None:
    runner = build_runner(mrope=True)
    model = runner.model
    compacted, features = _session_through_fold_1(runner)
    set_computed(runner, SESSION, len(compacted))
    # A consolidation by re-prefill: fold 2 resets, the whole history is recomputed from 0.
    history = [*compacted, 40]
    step(
        runner,
        [new_request(SESSION, history, 0, [7, 8], FoldControl(fold=2, reset=True), features)],
    )
    fresh, _ = _dense(model, history, features)
    check(torch.equal(_rows(runner, SESSION, len(history)), fresh), "reset keeps vLLM's rows")
    check(torch.equal(_scheduled_positions(runner, SESSION, len(history)), fresh), "reset kernel")
    set_computed(runner, SESSION, len(history))
    # Preempted, then back as a new request with the last fold's record: vLLM's rows again.
    step(runner, [], preempted=(SESSION,))
    resumed = [*history, 41, 42]
    step(runner, [new_request(SESSION, resumed, 0, [5], FoldControl(fold=2, reset=True), features)])
    fresh, _ = _dense(model, resumed, features)
    check(torch.equal(_rows(runner, SESSION, len(resumed)), fresh), "resume keeps vLLM's rows")
    check(
        runner.realtime_session_view("cam")
        == {"position_offset": 0, "folds": [0, 1, 2], "resumes": 1},
        "resume counted",
    )
    set_computed(runner, SESSION, len(resumed))
    # The next fold (no eviction) extends the resumed rows: held columns kept, chunk after.
    chunk = [50, *IMG]
    fold3 = FoldControl(fold=3, held_before=len(resumed), preemptions=1)
    after = resumed + chunk
    more = [*features, image("D", len(resumed) + 1)]
    step(runner, [new_request(SESSION, after, len(resumed), [5, 6], fold3, more)])
    rows = _rows(runner, SESSION, len(after))
    check(torch.equal(rows[:, : len(resumed)], fresh), "held columns kept at fold 3")
    dense_chunk, _ = _dense(model, chunk, [image("D", 1)])
    check(
        torch.equal(rows[:, len(resumed) :], dense_chunk + int(fresh.max()) + 1),
        f"fold 3 chunk columns {rows[:, len(resumed) :]}",
    )


def encoder_cache_entries_released() -> None:
    runner = build_runner(mrope=True)
    cache = runner.encoder_cache
    step(
        runner,
        [
            new_request(
                SESSION,
                FIRST,
                0,
                [4],
                FoldControl(fold=0, reset=True),
                [image("A", 3), image("B", 9)],
            )
        ],
    )
    # The encoder runner's outputs for both images (what `_execute_mm_encoder` stores).
    cache.encoder_outputs.update({"A": torch.zeros(4, 8), "B": torch.zeros(4, 8)})
    check(sorted(f.identifier for f in cache.mm_features[SESSION]) == ["A", "B"], "fold 0 items")
    set_computed(runner, SESSION, 15)
    compacted = FIRST[:3] + FIRST[7:] + DECODED + CHUNK
    features = [image("B", 5), image("C", 14)]
    fold1 = FoldControl(fold=1, held_before=17, evicted=((3, 7),))
    # The scheduler names the evicted item's hash (eviction.py's release); vLLM frees it.
    step(runner, [new_request(SESSION, compacted, 13, [4, 6], fold1, features)], free_hashes=("A",))
    check(
        sorted(cache.encoder_outputs) == ["B"], f"after the fold: {sorted(cache.encoder_outputs)}"
    )
    check(
        sorted(f.identifier for f in cache.mm_features[SESSION]) == ["B", "C"],
        "the re-added request lists the held and new items only",
    )
    stats = runner.realtime_worker_stats()
    check(stats["encoder_cache_entries"] == 1, f"worker stats {stats}")
    check(stats["mrope_columns_by_request"] == {"cam": len(compacted)}, f"worker stats {stats}")
    cache.encoder_outputs["C"] = torch.zeros(4, 8)
    step(runner, [], finished=(SESSION,), free_hashes=("B", "C"))
    check(len(cache) == 0 and SESSION not in cache.mm_features, "nothing left after close")
    check(runner._realtime_state() == {}, "our record dropped at close")


SCENARIOS: Final[dict[str, Callable[[], None]]] = {
    f.__name__: f
    for f in (
        positions_1d_after_eviction_and_slot_mappings,
        fold_and_preempted_request_arrive_as_new,
        mrope_rows_after_eviction_and_compaction,
        mrope_reset_and_resume_keep_vllms_rows,
        encoder_cache_entries_released,
    )
}


def main(out_path: str) -> None:
    import vllm
    from vllm.triton_utils import HAS_TRITON

    results: dict[str, str] = {}
    for name, scenario in SCENARIOS.items():
        try:
            scenario()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    report = {"vllm": str(vllm.__version__), "triton": bool(HAS_TRITON), "results": results}
    with open(out_path, "w", encoding="utf-8") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main(sys.argv[1])
