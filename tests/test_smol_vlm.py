"""`smol-qwen2-vl`: SmolLM2-135M inside Qwen2-VL, with a vision tower trained on synthetic frames.

It must (a) be SmolLM2 on text (greedy-equal through vLLM: zero q/k/v biases, and mRoPE gives
text tokens 1D positions), (b) name the colour of synthetic frames more often than chance and (c)
answer "green" when asked the colour of Chromium's fake-camera frame. Accuracy over 500 held-out
frames is `training/vlm_accuracy.py`'s job.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from realtime.models import build_model, model_dir
from realtime.models.smol_vlm import MROPE_SECTION, RENAMED_TOKENS, VISION_WEIGHTS
from tests.conftest import engine_settings
from training.synth_frames import FrameSpec, draw_frame, pacman_frame

NAME = "smol-qwen2-vl"


def test_vision_weights_ship_small() -> None:
    # Committed fp16 weights (the build only assembles files); the bound is 5 MB.
    assert VISION_WEIGHTS.stat().st_size < 5 * 1024 * 1024


def test_config_is_smollm2_with_mrope_and_vision_tokens() -> None:
    from transformers import AutoProcessor

    path = build_model(NAME)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["text_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (30, 576, 49152)
    # head_dim 64: the sections cover its 32 rotary frequencies exactly.
    assert sum(MROPE_SECTION) == 576 // 9 // 2 == sum(text["rope_parameters"]["mrope_section"])
    assert cfg["vision_config"]["hidden_size"] == 576
    proc = AutoProcessor.from_pretrained(str(path))
    tok = proc.tokenizer
    assert len(tok) == 49152  # SmolLM2's vocabulary: unused special ids were renamed, none added
    for i, name in RENAMED_TOKENS.items():
        assert tok.convert_tokens_to_ids(name) == i
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    text_prompt = "<|vision_start|><|image_pad|><|vision_end|>hi"
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    for size, tokens in (((112, 112), 16), ((640, 480), 12)):
        image = pacman_frame(size)
        out = proc(text=[text_prompt], images=[image], return_tensors="pt")
        # 112×112 → 8×8 patches → 4×4 merged; 640×480 is resized to 112×84 → 4×3.
        assert int((out["input_ids"] == pad).sum()) == tokens


@pytest.fixture(scope="module")
async def smol_vlm_engine() -> AsyncIterator[object]:
    from realtime.engine import start_engine

    engine = start_engine(
        engine_settings(NAME, extra={"limit_mm_per_prompt": {"image": 1, "video": 1}})
    )
    yield engine
    engine.shutdown()


async def _generate(engine, prompt, max_tokens: int):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams

    final = None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
        final = out
    assert final is not None
    return final.outputs[0]


@pytest.mark.slow
async def test_text_greedy_equals_smollm2(smol_vlm_engine) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.inputs import TokensPrompt

    ref_path = str(model_dir("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(ref_path)
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32)
    for prompt in ("What is the capital of France?", "Name three colors.", "Count to five."):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0]
        got = await _generate(smol_vlm_engine, TokensPrompt(prompt_token_ids=ids), 16)
        assert list(got.token_ids) == want[len(ids) :].tolist()[: len(got.token_ids)], prompt


@pytest.mark.slow
async def test_synthetic_frames_colour_is_named(smol_vlm_engine) -> None:  # type: ignore[no-untyped-def]
    from training.synth_frames import COLOURS, SHAPES
    from training.vlm_accuracy import QUESTIONS, prompt_for

    # One large shape per frame on white or black, every colour twice. A floor that catches a
    # broken tower or processor (random weights name ~1 in 6), not the measure: that is
    # training/vlm_accuracy.py (docs/history/vlm-2026.md: 99.7% of colours named on plain backgrounds).
    rng = random.Random(7)
    specs = [
        FrameSpec(c, SHAPES[i % 3], 1, ("white", "black")[j])
        for i, c in enumerate(COLOURS)
        for j in range(2)
    ]
    named = []
    for spec in specs:
        image, _ = draw_frame(spec, rng, (320, 240))
        reply = await _generate(smol_vlm_engine, prompt_for(image, QUESTIONS["colour"]), 24)
        named.append(spec.colour in reply.text.lower())
    assert sum(named) >= len(specs) // 2, named


@pytest.mark.slow
async def test_fake_camera_frame_is_described_as_green(smol_vlm_engine) -> None:  # type: ignore[no-untyped-def]
    from training.vlm_accuracy import DESCRIBE, prompt_for

    # Chromium's fake camera (a yellow pac-man on dark green) is described as green: the tower
    # writes the background's code into its own column (docs/history/vlm-2026.md, "Session 15"). Asked "What
    # colour is it?", the model names the object's colour, yellow, as it was trained to.
    reply = await _generate(smol_vlm_engine, prompt_for(pacman_frame(), DESCRIBE), 24)
    assert "green" in reply.text.lower(), reply.text


def test_positions_are_qwen2_vl_mrope() -> None:
    from training.vision_codes import IMAGE_PAD, positions

    # Two text tokens, a 4:3 image (6×8 patches → 3×4 merged), one text token.
    t, h, w = positions([1, 2] + [IMAGE_PAD] * 12 + [5], (6, 8))
    assert t == [0, 1] + [2] * 12 + [6]
    assert h[2:14] == [2 + r for r in range(3) for _ in range(4)]
    assert w[2:14] == [2 + c for _ in range(3) for c in range(4)]


@pytest.mark.slow
def test_code_tuning_model_equals_transformers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vision_codes.TextModel (plain torch, from the GGUF tensors) computes what transformers'
    Qwen2-VL language model computes, mRoPE image positions included."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from training import vision_codes as vc

    vc.pack(tmp_path)
    lm = vc.TextModel.load(tmp_path, "cpu", torch.float32)
    vlm = Qwen2VLForConditionalGeneration.from_pretrained(str(build_model(NAME)))
    vlm.eval()
    vecs = torch.randn(12, 576, generator=torch.Generator().manual_seed(0)) * 0.13

    class Fixed(torch.nn.Module):
        spatial_merge_size = 2
        dtype = torch.float32

        def forward(self, *_a: object, **_k: object) -> BaseModelOutputWithPooling:
            return BaseModelOutputWithPooling(pooler_output=vecs)

    vlm.model.visual = Fixed()
    seq = [1, 9690, 198] + [vc.VISION_START] + [vc.IMAGE_PAD] * 12 + [vc.VISION_END, 2, 198]
    ids = torch.tensor([seq])
    with torch.no_grad():
        ref = vlm.model(
            input_ids=ids,
            pixel_values=torch.zeros(48, 1176),
            image_grid_thw=torch.tensor([[1, 6, 8]]),
            mm_token_type_ids=(ids == vc.IMAGE_PAD).long(),
        ).last_hidden_state
        x = lm.emb[ids].clone()
        x[ids == vc.IMAGE_PAD] = vecs
        mine = lm.hidden(x, vc.batch_positions([seq], [(6, 8)], "cpu"))
    assert (ref - mine).abs().max() < 1e-3


def test_objcol_targets_are_single_words_by_place() -> None:
    # The "objcol" stage-1 layout (docs/history/vlm-2026.md, third round): object patches carry the colour
    # word, all others the shape word (plural for several shapes); never a sum.
    import torch

    from training.vision_train import Targets

    vocab = {" red": 0, " circle": 1, " circles": 2, " white": 3}

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [vocab[text]]

    emb = torch.eye(4)
    cov = torch.tensor([0.0, 0.5, 0.2, 1.0])
    two = Targets(emb, Tok(), layout="objcol").for_frame(
        FrameSpec("red", "circle", 2, "white"), cov
    )
    assert two.argmax(-1).tolist() == [2, 0, 2, 0] and bool((two.sum(-1) == 1).all())
    one = Targets(emb, Tok(), layout="objcol").for_frame(
        FrameSpec("red", "circle", 1, "white"), cov
    )
    assert one.argmax(-1).tolist() == [1, 0, 1, 0]


def test_mixed_targets_add_the_background_word_only_on_a_coloured_background() -> None:
    # The shipped "mixed" layout (docs/history/vlm-2026.md, fourth round): "objcol" on white/black; on a
    # coloured background the non-object patches carry " <background>" + " <shape(s)>".
    import torch

    from training.vision_train import Targets

    vocab = {" red": 0, " circle": 1, " circles": 2, " white": 3, " green": 4}

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [vocab[text]]

    emb = torch.eye(5)
    cov = torch.tensor([0.0, 0.5])
    targets = Targets(emb, Tok(), layout="mixed")
    plain = targets.for_frame(FrameSpec("red", "circle", 2, "white"), cov)
    assert plain.tolist() == [emb[2].tolist(), emb[0].tolist()]
    green = targets.for_frame(FrameSpec("red", "circle", 2, "green"), cov)
    assert green.tolist() == [(emb[4] + emb[2]).tolist(), emb[0].tolist()]


def test_object_coverage_sets_which_patches_carry_the_colour_word() -> None:
    # --object-coverage (docs/history/vlm-2026.md, fifth round): with 0.1 a patch 20% covered by the shapes
    # carries the colour word; with the default 0.3 it carries the shape word.
    import torch

    from training.vision_train import OBJECT_COVERAGE, Targets

    vocab = {" red": 0, " circle": 1, " circles": 2}

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [vocab[text]]

    emb = torch.eye(3)
    cov = torch.tensor([0.0, 0.05, 0.2, 0.5])
    spec = FrameSpec("red", "circle", 1, "white")
    default = Targets(emb, Tok(), layout="mixed").for_frame(spec, cov)
    assert OBJECT_COVERAGE == 0.3 and default.argmax(-1).tolist() == [1, 1, 1, 0]
    low = Targets(emb, Tok(), layout="mixed", object_coverage=0.1).for_frame(spec, cov)
    assert low.argmax(-1).tolist() == [1, 1, 0, 0]


def test_fidelity_schedule_replays_the_first_frames_at_the_end() -> None:
    from bench.vlm_fidelity import MARKER, PAIRED, schedule

    chunks = schedule(300, window=8, probe_every=25)
    frames = [what for kind, what in chunks if kind == "frame"]
    assert [n for n, _, _ in frames] == list(range(300))
    first, last = frames[:PAIRED], frames[-PAIRED:]
    assert [(s, seed) for _, s, seed in first] == [(s, seed) for _, s, seed in last]
    assert any(s.colour == MARKER for _, s, _ in first)  # markers (and their probes) replay too
    probes = [what for kind, what in chunks if kind == "probe"]
    assert {"near", "far"} <= set(probes)
    # A near probe follows its marker (the default gap, 1); a far one comes window + 8 later.
    for i, (kind, what) in enumerate(chunks):
        if kind == "probe" and what == "near":
            assert chunks[i - 1][0] == "frame" and chunks[i - 1][1][1].colour == MARKER
    gap2 = schedule(300, window=8, probe_every=25, near_gap=2)
    near2 = [i for i, (k, w) in enumerate(gap2) if k == "probe" and w == "near"]
    assert near2 and all(gap2[i - 2][1][1].colour == MARKER for i in near2)
    # Too short to pair: no replay.
    short = [what for kind, what in schedule(150, window=8, probe_every=25) if kind == "frame"]
    assert [(s, seed) for _, s, seed in short[:50]] != [(s, seed) for _, s, seed in short[-50:]]


def _fake_codes_data() -> dict[str, Any]:
    """Token ids of the prompt pieces, made up: each reply names its fact with one token."""
    from training import vision_codes as vc

    kinds = list(vc.QUESTIONS)
    words = sorted({w for ws in vc.ATTRIBUTES.values() for w in ws})
    name_id = {w: 500 + i for i, w in enumerate(words)}
    return {
        "heads": [[100], [101, 102]],
        "user": [110, 111],
        "intro": [120, 121, 122],
        "user_close": [130, 131],
        "newline": [131],
        "questions": {k: [[200 + i, 2, 198]] for i, k in enumerate(kinds)},
        "answers": {
            k: {vc._key(s): [300 + i, name_id[vc.fact(k, s)], 2] for s in vc.all_specs()}
            for i, k in enumerate(kinds)
        },
        "names": {str(i): w for w, i in name_id.items()},
        "words": {a: {w: name_id[w] for w in ws} for a, ws in vc.ATTRIBUTES.items()},
    }


class _FakeLM:
    """The slice of vision_codes.TextModel the chat code reads; a hidden state is the mean of
    the inputs so far (causal, so a reply sees its frame)."""

    def __init__(self) -> None:
        import torch

        self.emb = torch.randn(1000, 8, generator=torch.Generator().manual_seed(0))
        self.device, self.dtype = "cpu", torch.float32

    def hidden(self, x: Any, pos: Any) -> Any:
        import torch

        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[None, :, None]


def test_multi_frame_chats_carry_one_vector_per_image_and_every_reply() -> None:
    """Codes tuned on several frames per chat (the fix for replies copied across frames): each
    image's slots get its own frame's vector, the replies are where the loss looks, and the
    mRoPE positions advance past each image."""
    import torch

    from training import vision_codes as vc

    d = _fake_codes_data()
    chats = vc.build_chats(d, random.Random(3), 6, frames=4)
    for c in chats:
        ntok = c.grid[0] * c.grid[1] // 4
        assert c.ids.count(vc.IMAGE_PAD) == 4 * ntok and len(c.specs) == 4
        assert 1 <= len(c.replies) <= 4 and c.replies[-1][1] == len(c.ids)  # last frame asked
        for start, end, kind in c.replies:
            assert (
                c.ids[start:end] == d["answers"][kind][vc._key(c.specs[vc._image_before(c, start)])]
            )
        t_axis = vc.positions(c.ids, c.grid)[0]
        assert t_axis == sorted(t_axis) and len(t_axis) == len(c.ids)

    lm = _FakeLM()
    lm.emb = torch.zeros(1000, 4)
    vecs = torch.arange(24, dtype=torch.float32)[:, None].expand(24, 4)
    x = vc.embed_chats(lm, chats, vecs, 0.0, None)  # type: ignore[arg-type]
    for b, c in enumerate(chats):
        slots = [j for j, t in enumerate(c.ids) if t == vc.IMAGE_PAD]
        ntok = len(slots) // 4
        for j, slot in enumerate(slots):
            assert x[b, slot, 0] == 4 * b + j // ntok
        assert x[b, 0].abs().sum() == 0  # text slots keep their (here zero) embeddings
    evals = vc.build_chats(d, random.Random(3), 6, frames=4, last_answer=False)
    assert all(c.replies[-1][0] == c.replies[-1][1] == len(c.ids) for c in evals)


def test_wrong_earlier_replies_repeat_one_wrong_word_and_stay_out_of_the_loss() -> None:
    """Sessions answered "The colour is white." and later frames copied it; chats with such a
    streak teach the codes to be read past it. The wrong replies name one word per chat, never
    the frame's own fact, the last reply is always right, and the loss skips the wrong ones."""
    import torch

    from training import vision_codes as vc

    d = _fake_codes_data()
    names = {int(i): w for i, w in d["names"].items()}
    chats = vc.build_chats(d, random.Random(5), 40, frames=6, mistakes=1.0)
    assert sum(len(c.wrong) for c in chats) > 40
    for c in chats:
        assert len(c.replies) - 1 not in c.wrong
        said: dict[str, set[str]] = {}
        for r, (start, end, kind) in enumerate(c.replies):
            spec = c.specs[vc._image_before(c, start)]
            words = {names[t] for t in c.ids[start:end] if t in names}
            if r in c.wrong:
                assert vc.fact(kind, spec) not in words
                said.setdefault(kind, set()).update(words)
            else:
                assert c.ids[start:end] == d["answers"][kind][vc._key(spec)]
        assert all(len(w) == 1 for w in said.values())  # a streak: one wrong word per kind
    # Without mistakes the chats are the same as before the option existed (same draws).
    plain = vc.build_chats(d, random.Random(5), 5, frames=6)
    assert all(not c.wrong for c in plain)
    assert [c.ids for c in plain] == [c.ids for c in vc.build_chats(d, random.Random(5), 5, 6)]

    lm = _FakeLM()
    codes = {
        a: torch.nn.Parameter(torch.randn(len(ws), 8, generator=torch.Generator().manual_seed(1)))
        for a, ws in vc.ATTRIBUTES.items()
    }
    one = [c for c in chats if c.wrong][:1]
    right_only = vc.Chat(one[0].ids, one[0].specs, one[0].replies, one[0].grid, frozenset())
    a = vc.chat_loss(lm, codes, one, 0.0, None, "place")  # type: ignore[arg-type]
    b = vc.chat_loss(lm, codes, [right_only], 0.0, None, "place")  # type: ignore[arg-type]
    assert float(a) != float(b)  # the wrong replies' tokens are not scored


def test_drifting_chats_turn_terse_from_one_frame_on_and_stay_terse() -> None:
    """A long session's replies drifted from "The colour is green." to "Green." and then copied
    it; drifting chats train the codes to be read in that format too. From one answered frame
    on, every reply (the last, scored one too) is the terse form; its wrong ones are another
    frame's terse reply."""
    from training import vision_codes as vc

    d = _fake_codes_data()
    name_id = {w: int(i) for i, w in d["names"].items()}
    d["short"] = {
        k: {vc._key(s): [400, name_id[vc.fact(k, s)], 2] for s in vc.all_specs()}
        for k in vc.QUESTIONS
    }
    chats = vc.build_chats(d, random.Random(9), 30, frames=6, mistakes=0.5, drift=1.0)
    for c in chats:
        terse = [c.ids[start] == 400 for start, _end, _kind in c.replies]
        assert terse[-1] and terse == sorted(terse)  # once terse, terse to the end
        for r, (start, end, kind) in enumerate(c.replies):
            spec = c.specs[vc._image_before(c, start)]
            right = d["short"][kind][vc._key(spec)] if terse[r] else None
            if terse[r] and r not in c.wrong:
                assert c.ids[start:end] == right
            elif terse[r]:
                assert c.ids[start:end] != right and c.ids[start] == 400
    assert any(c.wrong for c in chats)


def test_collapsed_chats_carry_degenerate_wrong_replies_out_of_the_loss() -> None:
    """A 1,000-frame session fell into "The green of the green is the"; chats whose wrong
    replies are such degenerate texts (one colour word per chat) train the codes to be read
    past them. Those replies stay out of the loss, the scored last reply is a right one, and
    `collapse` 0 draws nothing new (old chats unchanged)."""
    from training import vision_codes as vc

    d = _fake_codes_data()
    d["collapsed"] = {w: [[500 + i, 501 + i, 502 + i], [600 + i, 2]] for i, w in enumerate("ab")}
    degenerate = {tuple(v) for vs in d["collapsed"].values() for v in vs}
    chats = vc.build_chats(d, random.Random(9), 40, frames=6, mistakes=1.0, collapse=1.0)
    for c in chats:
        texts = [tuple(c.ids[start:end]) for start, end, _kind in c.replies]
        assert texts[-1] not in degenerate and len(c.replies) - 1 not in c.wrong
        assert {r for r, t in enumerate(texts) if t in degenerate} == set(c.wrong)
        words = {t[0] - (500 if t[0] < 600 else 600) for t in texts if t in degenerate}
        assert len(words) <= 1  # one colour word per chat
    assert any(c.wrong for c in chats)
    plain = vc.build_chats(d, random.Random(9), 10, frames=6, mistakes=1.0)
    again = vc.build_chats(d, random.Random(9), 10, frames=6, mistakes=1.0, collapse=0.0)
    assert [c.ids for c in plain] == [c.ids for c in again]


def test_chat_loss_reaches_the_codes_and_the_chat_score_is_a_rate() -> None:
    import torch

    from training import vision_codes as vc

    d, lm = _fake_codes_data(), _FakeLM()
    codes = {
        a: torch.nn.Parameter(torch.randn(len(ws), 8, generator=torch.Generator().manual_seed(1)))
        for a, ws in vc.ATTRIBUTES.items()
    }
    chats = vc.build_chats(d, random.Random(5), 4, frames=3)
    vc.chat_loss(lm, codes, chats, 0.1, torch.Generator().manual_seed(2)).backward()  # type: ignore[arg-type]
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in codes.values())
    score = vc.evaluate_chats(lm, d, codes, frames=3, n=30, batch=7)  # type: ignore[arg-type]
    assert score["n"] == 30 and set(score) <= {"same", "mixed", "n", "copied_previous"}
    assert all(0.0 <= score[k] <= 1.0 for k in ("same", "mixed") if k in score)


def test_chat_scores_cover_every_variant_the_prepared_data_allows() -> None:
    """`chat_scores`: 1 and `frames` frames, then the streak variants; the terse and the
    degenerate ones only where `prepare` wrote their replies. Each is a rate."""
    import torch

    from training import vision_codes as vc

    d, lm = _fake_codes_data(), _FakeLM()
    codes = {
        a: torch.randn(len(ws), 8, generator=torch.Generator().manual_seed(1))
        for a, ws in vc.ATTRIBUTES.items()
    }
    plain = vc.chat_scores(lm, d, codes, 3, 10, "sum")  # type: ignore[arg-type]
    assert set(plain) == {"frames_1", "frames_3", "frames_3_mistakes", "frames_3_streak"}
    name_id = {w: int(i) for i, w in d["names"].items()}
    d["short"] = {
        k: {vc._key(s): [400, name_id[vc.fact(k, s)], 2] for s in vc.all_specs()}
        for k in vc.QUESTIONS
    }
    d["collapsed"] = {w: [[500 + i, 501 + i, 502 + i], [600 + i, 2]] for i, w in enumerate("ab")}
    every = vc.chat_scores(lm, d, codes, 3, 10, "sum")  # type: ignore[arg-type]
    assert set(every) == set(plain) | {"frames_3_terse_streak", "frames_3_collapsed"}
    assert all(
        0.0 <= v <= 1.0 for s in every.values() for k, v in s.items() if k in ("same", "mixed")
    )


def test_place_layout_puts_one_attribute_code_in_each_slot() -> None:
    """The "place" layout: slot j of an image carries its frame's code of attribute j mod 4
    (colour, shape, count, background) alone; the tower's targets follow the same order, and
    the loss reaches every code through it."""
    import torch

    from training import vision_codes as vc

    d, lm = _fake_codes_data(), _FakeLM()
    codes = {
        a: torch.nn.Parameter(torch.randn(len(ws), 8, generator=torch.Generator().manual_seed(1)))
        for a, ws in vc.ATTRIBUTES.items()
    }
    chats = vc.build_chats(d, random.Random(7), 5, frames=3)
    specs = [s for c in chats for s in c.specs]
    parts = vc.image_vectors(codes, specs, "place")
    assert parts.shape == (len(specs), 4, 8)
    assert torch.equal(vc.image_vectors(codes, specs, "sum"), parts.sum(1))
    x = vc.embed_chats(lm, chats, parts, 0.0, None)  # type: ignore[arg-type]
    first = 0
    for b, c in enumerate(chats):
        ntok = c.grid[0] * c.grid[1] // 4
        slots = [j for j, t in enumerate(c.ids) if t == vc.IMAGE_PAD]
        for j, slot in enumerate(slots):
            assert torch.equal(x[b, slot], parts[first + j // ntok, (j % ntok) % 4])
        first += len(c.specs)
    target = vc.slot_targets(codes, specs[0], 16, "place")
    assert torch.equal(target[5], parts[0, 1]) and target.shape == (16, 8)
    vc.chat_loss(lm, codes, chats, 0.1, torch.Generator().manual_seed(2), "place").backward()  # type: ignore[arg-type]
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in codes.values())
    score = vc.evaluate_chats(lm, d, codes, frames=3, n=20, batch=7, layout="place")  # type: ignore[arg-type]
    assert score["n"] == 20
    with pytest.raises(ValueError, match="layout"):
        vc.image_vectors(codes, specs, "rows")


def test_fidelity_reply_formats_are_valid_session_formats() -> None:
    """`bench.vlm_fidelity --reply-format`: the constrained formats are response_formats the
    protocol accepts, listing the tuned sentences; free text sends none."""
    from bench.vlm_fidelity import frame_prompt, reply_format
    from training.synth_frames import COLOURS
    from vllm_realtime_protocol import SamplingConfig

    assert reply_format("free") == {}
    sentence = SamplingConfig.model_validate(reply_format("sentence")).response_format
    assert sentence is not None and sentence.type == "json_schema"
    assert sentence.json_schema.schema_["enum"] == [f"The colour is {c}." for c in COLOURS]
    describe = reply_format("describe")["response_format"]["json_schema"]["schema"]["enum"]
    assert "Two red circles on a white background." in describe and len(set(describe)) > 300
    assert frame_prompt("describe") == "Describe the image." and frame_prompt("free") != ""
