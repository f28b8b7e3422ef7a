"""Can SmolLM2 read a frame laid out as words? Exact targets in place of the tower, no training.

Each layout fills the image tokens of a first-frame chat (rendered as the server renders it, with
`training/vlm_accuracy.py`'s instructions and questions) with exact SmolLM2 word embeddings, in
transformers (float32, greedy): the vision tower is replaced by a stub that returns them, so the
model's own mRoPE positions apply. A layout is what a perfect stage-1 tower would emit. Cases:
6 colours × 3 shapes × counts 1–3, on white; three questions each.

Layouts (16 merged tokens, row-major; `@1x16` = the same tokens on a 1×16 grid, `@text` = the
same words given as text tokens, i.e. 1D positions, the upper bound):
  sum      every token = " red" + " circle"          (the shipped targets)
  sum3     every token = " two" + " red" + " circles"
  rows     tokens 0–7 = " red", 8–15 = " circles"
  alt      " red", " circles", " red", " circles", …
  phrase   the tokens of " two red circles" repeated over the 16 tokens
  content  a 112×112 frame's object patches = " red" + " circles", background patches = " white"
  objcol   object patches = " red", background patches = " circles"
  sumbg    object patches = " red" + " circles", background patches = the background's word
           (the "sum" and "mixed" stage-1 targets on a coloured background)
  objbgsum object patches = " red", background patches = the background's word + " circles"
  mixed    objcol on white/black, objbgsum on a colour (the shipped "mixed" tower's targets);
           mixed10, mixed01: the same with patches at least 10% (1%) covered counted as object
           patches (vision_train.py --object-coverage); mixedc15 the colour word ×1.5;
           mixedb05, mixed10b05 the background's word ×0.5
  edge     only partly covered patches carry " circles", all others " red" (+ the background's
           word off the shapes, on a colour)
  swap     object patches " circles", all others " red" (no background word)
  count    objcol with " two" added to the shape word

`--noise 0.3` adds Gaussian noise of 0.3 × the embeddings' standard deviation to every image
token (the shipped tower's residual is ~0.26 of it), to see which layout survives an imprecise
tower.

`--background green` draws the cases on a coloured background; the kind `describe` ("Describe
the image.") counts a reply that names the background's colour (what Chromium's green fake
camera needs).

    python -m bench.vlm_reading --layouts sum,rows,alt --out docs/bench/vlm_reading.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from training.synth_frames import COLOURS, COUNT_WORDS, SHAPES, FrameSpec, draw_frame
from training.vlm_accuracy import DESCRIBE, INSTRUCTIONS, QUESTIONS, named

N_TOKENS = 16


def plural(shape: str, count: int) -> str:
    return shape + ("s" if count > 1 else "")


class Words:
    def __init__(self, emb: Any, tok: Any) -> None:
        self.emb, self.tok = emb, tok

    def ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def one(self, word: str) -> Any:
        """Embedding of " word" (the sum over its tokens if it has several)."""
        return self.emb[self.ids(" " + word)].sum(0)


def cycle(vectors: list[Any], n: int = N_TOKENS) -> Any:
    import torch

    return torch.stack([vectors[i % len(vectors)] for i in range(n)])


def layout(name: str, spec: FrameSpec, w: Words) -> tuple[Any, list[int] | None]:
    """(N_TOKENS × 576 image-token embeddings, or the phrase's token ids for `@text`)."""
    import torch

    from training.vision_train import coverage

    c, s, n = spec.colour, plural(spec.shape, spec.count), COUNT_WORDS[spec.count]
    if name == "sum":
        return cycle([w.one(c) + w.one(spec.shape)]), None
    if name == "sum3":
        return cycle([w.one(n) + w.one(c) + w.one(s)]), None
    if name == "rows":
        return torch.stack([w.one(c)] * 8 + [w.one(s)] * 8), None
    if name == "alt":
        return cycle([w.one(c), w.one(s)]), None
    if name == "phrase":
        ids = w.ids(f" {n} {c} {s}")
        return cycle([w.emb[i] for i in ids]), ids
    _img, mask = draw_frame(spec, random.Random(f"{c} {s} {n}"), size=(112, 112))
    cov = coverage(mask, 8, 8).tolist()
    if name in ("content", "objcol", "sumbg", "objbgsum"):
        obj, bg = {
            "content": (w.one(c) + w.one(s), w.one(spec.background)),
            "objcol": (w.one(c), w.one(s)),
            "sumbg": (w.one(c) + w.one(spec.shape), w.one(spec.background)),
            "objbgsum": (w.one(c), w.one(spec.background) + w.one(s)),
        }[name]
        return torch.stack([obj if x >= 0.3 else bg for x in cov]), None
    if name in EXPERIMENTS:
        return torch.stack(EXPERIMENTS[name](spec, w, cov)), None
    raise ValueError(name)


def _edge(spec: FrameSpec, w: Words, cov: list[float]) -> list[Any]:
    """Only the shapes' edge patches (partly covered) carry the shape word; all others the
    colour word (plus the background's word on a coloured background)."""
    c, s = w.one(spec.colour), w.one(plural(spec.shape, spec.count))
    bg = c + w.one(spec.background) if spec.background not in ("white", "black") else c
    return [s if 0.0 < x < 0.3 else (c if x >= 0.3 else bg) for x in cov]


def _swap(spec: FrameSpec, w: Words, cov: list[float]) -> list[Any]:
    """Object patches carry the shape word, all others the colour word."""
    c, s = w.one(spec.colour), w.one(plural(spec.shape, spec.count))
    return [s if x >= 0.3 else c for x in cov]


def _objcol_at(threshold: float, colour: float = 1.0, bgword: float = 1.0) -> Any:
    """objcol (mixed on a coloured background) with another object threshold, the colour word
    scaled and the background's word scaled."""

    def f(spec: FrameSpec, w: Words, cov: list[float]) -> list[Any]:
        c, s = colour * w.one(spec.colour), w.one(plural(spec.shape, spec.count))
        if spec.background not in ("white", "black"):
            s = s + bgword * w.one(spec.background)
        return [c if x >= threshold else s for x in cov]

    return f


def _count(spec: FrameSpec, w: Words, cov: list[float]) -> list[Any]:
    """objcol with the count word added to the shape word (" two" + " circles")."""
    c = w.one(spec.colour)
    s = w.one(plural(spec.shape, spec.count)) + w.one(COUNT_WORDS[spec.count])
    return [c if x >= 0.3 else s for x in cov]


EXPERIMENTS: dict[str, Any] = {
    "edge": _edge,
    "swap": _swap,
    "mixed": _objcol_at(0.3),
    "mixed10": _objcol_at(0.1),
    "mixed01": _objcol_at(0.01),
    "mixedc15": _objcol_at(0.3, colour=1.5),
    "mixedb05": _objcol_at(0.3, bgword=0.5),
    "mixed10b05": _objcol_at(0.1, bgword=0.5),
    "count": _count,
}


def stub_tower() -> Any:
    """Stands in for the vision tower: returns the embeddings put in its `out`."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    class StubTower(torch.nn.Module):
        spatial_merge_size = 2
        dtype = torch.float32

        def __init__(self) -> None:
            super().__init__()
            self.out: Any = None

        def forward(self, pixel_values: Any, grid_thw: Any = None, **_: Any) -> Any:
            return BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=self.out)

    return StubTower()


def scored(kind: str, spec: FrameSpec, reply: str) -> bool:
    if kind == "describe":
        return spec.background in reply.lower()
    return named(kind, spec, reply)


def run(
    layouts: list[str],
    model_path: Path,
    max_new_tokens: int,
    counts: list[int],
    kinds: list[str],
    background: str = "white",
    noise: float = 0.0,
) -> Any:
    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    torch.set_num_threads(2)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(model_path))
    emb = model.get_input_embeddings().weight.detach()
    w = Words(emb, tok)
    stub = stub_tower()
    model.model.visual = stub  # type: ignore[assignment]
    specs = [
        FrameSpec(c, s, n, background)
        for n in counts
        for c in COLOURS
        if c != background
        for s in SHAPES
    ]
    results: dict[str, Any] = {}
    for full in layouts:
        name, _, where = full.partition("@")
        t0 = time.perf_counter()
        rows: list[dict[str, Any]] = []
        for kind in kinds:
            question = QUESTIONS.get(kind, DESCRIBE)
            vecs, texts = [], []
            for spec in specs:
                v, ids = layout(name, spec, w)
                if where == "text":
                    assert ids is not None, "@text needs a phrase layout"
                    words = tok.decode([ids[i % len(ids)] for i in range(N_TOKENS)])
                    image = words
                else:
                    image = "<|image_pad|>" * N_TOKENS
                    vecs.append(v)
                texts.append(
                    f"<|im_start|>system\n{INSTRUCTIONS}<|im_end|>\n<|im_start|>user\n"
                    f"<|vision_start|>{image}<|vision_end|>{question}<|im_end|>\n"
                    "<|im_start|>assistant\n"
                )
            enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
            assert enc["attention_mask"].all(), "prompts of one question have one length"
            kw: dict[str, Any] = {}
            if vecs:
                grid = (1, 2, 2 * N_TOKENS) if where == "1x16" else (1, 8, 8)
                kw["image_grid_thw"] = torch.tensor([grid] * len(specs))
                kw["pixel_values"] = torch.zeros(len(specs) * N_TOKENS * 4, 1176)
                stub.out = torch.cat(vecs)
                if noise:
                    # What an imprecise tower emits: Gaussian noise, `noise` × the embeddings'
                    # standard deviation per dimension (the shipped tower: ~0.26).
                    gen = torch.Generator().manual_seed(len(rows))
                    jitter = torch.randn(stub.out.shape, generator=gen)
                    stub.out = stub.out + noise * float(emb.std()) * jitter
            with torch.no_grad():
                out = model.generate(
                    **enc, **kw, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1
                )
            replies = tok.batch_decode(
                out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
            )
            for spec, reply in zip(specs, replies, strict=True):
                rows.append(
                    {
                        "spec": spec.__dict__,
                        "kind": kind,
                        "reply": reply.strip(),
                        "ok": scored(kind, spec, reply),
                    }
                )
        score = {kind: sum(r["ok"] for r in rows if r["kind"] == kind) for kind in kinds}
        results[full] = {
            "n": len(specs),
            "named": score,
            "seconds": time.perf_counter() - t0,
            "rows": rows,
        }
        print(full, len(specs), score, f"{time.perf_counter() - t0:.0f}s", flush=True)
        for r in rows[:: max(1, len(rows) // 6)]:
            print(
                "   ",
                r["kind"],
                r["spec"]["colour"],
                r["spec"]["shape"],
                r["spec"]["count"],
                "->",
                repr(r["reply"]),
            )
    return results


def main() -> None:
    from realtime.models import model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="sum,rows,alt,phrase")
    ap.add_argument("--counts", default="1,2,3")
    ap.add_argument("--kinds", default="colour,shape,count")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--background", default="white")
    ap.add_argument("--noise", type=float, default=0.0, help="× the embeddings' std, per dim")
    args = ap.parse_args()
    path = args.model or model_dir("smol-qwen2-vl")
    res = run(
        args.layouts.split(","),
        path,
        args.max_new_tokens,
        [int(x) for x in args.counts.split(",")],
        args.kinds.split(","),
        args.background,
        args.noise,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
