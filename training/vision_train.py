"""Train the vision tower of `smol-qwen2-vl` on synthetic frames, on CPU, in minutes.

Theory of operation: no gradient flows through the language model. Each merged patch (28×28
pixels after the processor's resize) is given a target in SmolLM2's input-embedding space, built
from the frame's facts: every patch carries the sum of the embeddings of the words for the
shapes' colour, their kind and their number (" red" + " circle" + " two"); a background patch
also carries its background's colour word (" green"). The tower (a Qwen2-VL encoder: 2-D rotary
attention, so it sees the whole frame) and its merger are fitted to these targets with a mean
squared error. The language model then reads a frame as a few superposed words, which it
answers about (measured: `training/vlm_accuracy.py`).

Usage (writes the packaged weights; the language model must be built first):

    python -m training.vision_train --out realtime/models/data/smol_vlm_vision.safetensors

Deterministic for a given thread count (seeded data and initialisation); the shipped file is what
`models build` uses, so builds never depend on this run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from realtime.models.smol_vlm import MERGE_SIZE, PATCH_SIZE
from training.synth_frames import (
    COUNT_WORDS,
    NEUTRAL_BACKGROUNDS,
    FrameSpec,
    draw_frame,
    jpeg,
    processor,
    random_spec,
)

CELL = PATCH_SIZE * MERGE_SIZE
OBJECT_COVERAGE = 0.3  # a merged patch at least this much covered by shapes is an object patch
# Target layouts: "sum" (every patch " <colour>" + " <shape>"; background words on a coloured
# background), "objcol" (object patches " <colour>", the others " <shape(s)>"), or "mixed"
# ("objcol" on white/black, which SmolLM2 reads best; on a coloured background the other patches
# carry " <background>" + " <shape(s)>", so that a green scene such as Chromium's fake camera can
# still read as green). Read with exact targets (the one-off bench/vlm_reading.py, docs/history/vlm-2026.md "Third round").
LAYOUTS = ("sum", "objcol", "mixed")


def word_embeddings(smollm2_dir: Path) -> tuple[Any, Any]:
    """SmolLM2's input embedding matrix and its tokenizer."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    return emb, AutoTokenizer.from_pretrained(str(smollm2_dir))


class Targets:
    """Per-merged-patch target embeddings for a frame (see the module docstring)."""

    def __init__(
        self,
        emb: Any,
        tok: Any,
        codes: dict[str, Any] | None = None,
        layout: str = "sum",
        object_coverage: float = OBJECT_COVERAGE,
    ) -> None:
        assert layout in LAYOUTS, layout
        self.emb, self.tok, self.codes, self.layout = emb, tok, codes, layout
        self.object_coverage = object_coverage
        self.codes_layout = "sum"  # vision_codes.LAYOUTS: how `codes` fill a frame's slots

    def candidates(self) -> tuple[list[tuple[str, ...]], Any]:
        """Every vector a patch target can be, with the words it sums: single colour and shape
        words (singular and plural) and colour + shape sums. The discriminative loss and the
        held-out decoding pick among these."""
        import torch

        from training.synth_frames import COLOURS, SHAPES

        names: list[tuple[str, ...]] = [(c,) for c in COLOURS]
        names += [(s,) for s in SHAPES] + [(s + "s",) for s in SHAPES]
        names += [(c, s) for c in COLOURS for s in SHAPES]
        names += [(c, s + "s") for c in COLOURS for s in SHAPES]
        names += [(b,) for b in NEUTRAL_BACKGROUNDS]
        table = torch.stack([torch.stack([self.word(w) for w in n]).sum(0) for n in names])
        return names, table

    def word(self, w: str) -> Any:
        ids = self.tok.encode(" " + w, add_special_tokens=False)
        assert len(ids) == 1, (w, ids)
        return self.emb[ids[0]]

    def for_frame(self, spec: FrameSpec, coverage: Any) -> Any:
        import torch

        if self.codes is not None:
            from training.vision_codes import slot_targets

            return slot_targets(self.codes, spec, len(coverage), self.codes_layout)

        neutral = spec.background in NEUTRAL_BACKGROUNDS
        if self.layout == "objcol" or (self.layout == "mixed" and neutral):
            # Object patches read as the colour word, every other patch as the shape word
            # (plural when there are several): single words, not sums (docs/history/vlm-2026.md, third round).
            colour = self.word(spec.colour)
            shape = self.word(spec.shape + ("s" if spec.count > 1 else ""))
            return torch.stack([colour if c >= self.object_coverage else shape for c in coverage])
        if self.layout == "mixed":
            colour = self.word(spec.colour)
            other = self.word(spec.background) + self.word(
                spec.shape + ("s" if spec.count > 1 else "")
            )
            return torch.stack([colour if c >= self.object_coverage else other for c in coverage])
        fact = self.word(spec.colour) + self.word(spec.shape)
        if neutral:
            return fact.expand(len(coverage), -1).clone()
        bg = self.word(spec.background)
        return torch.stack([fact if c >= self.object_coverage else bg for c in coverage.tolist()])


def coverage(mask: Any, grid_h: int, grid_w: int) -> Any:
    """Fraction of each merged patch covered by shapes, in the processor's token order."""
    import numpy as np
    from PIL import Image

    h, w = grid_h * PATCH_SIZE, grid_w * PATCH_SIZE
    m = np.asarray(mask.resize((w, h), Image.BILINEAR), dtype=np.float32) / 255.0
    return m.reshape(h // CELL, CELL, w // CELL, CELL).mean(axis=(1, 3)).reshape(-1)


def make_dataset(
    n: int, seed: int, targets: Targets, workers: int = 0
) -> list[tuple[Any, Any, Any, FrameSpec]]:
    """n frames as (pixel patches fp16, grid_thw, target embeddings, spec). With `workers`, drawn
    in chunks of 500 (chunk i seeded with (seed, i)) by a process pool: same frames for any
    number of workers."""
    if workers:
        from concurrent.futures import ProcessPoolExecutor

        import torch.multiprocessing

        # Thousands of tensors come back from the pool: passed as file descriptors (torch's
        # default) they failed here with "received 0 items of ancdata".
        torch.multiprocessing.set_sharing_strategy("file_system")
        chunks = [(min(500, n - i), seed * 1_000_003 + i // 500) for i in range(0, n, 500)]
        with ProcessPoolExecutor(workers) as pool:
            parts = pool.map(_chunk, [(k, sd, targets) for k, sd in chunks])
            return [x for part in parts for x in part]
    return _frames(n, seed, targets)


def _chunk(args: tuple[int, int, Targets]) -> list[tuple[Any, Any, Any, FrameSpec]]:
    import torch

    torch.set_num_threads(1)
    return _frames(*args)


def _frames(n: int, seed: int, targets: Targets) -> list[tuple[Any, Any, Any, FrameSpec]]:
    import torch

    rng = random.Random(seed)
    proc = processor()
    data = []
    for _ in range(n):
        spec = random_spec(rng)
        img, mask = draw_frame(spec, rng)
        out = proc(images=[jpeg(img, rng)], return_tensors="pt")
        grid = out["image_grid_thw"][0]
        cov = coverage(mask, int(grid[1]), int(grid[2]))
        data.append(
            (out["pixel_values"].to(torch.float16), grid, targets.for_frame(spec, cov), spec)
        )
    return data


INSTRUCTIONS = (
    "You are a vision assistant. Answer in one short sentence.",
    "You watch a camera. In one short sentence, say what you see.",
    None,
)
QUESTIONS = {
    "colour": ("What colour is it?", "What color is the shape?"),
    "shape": ("What is the shape?", "Which shape is it?"),
    "count": ("How many shapes are there?",),
    "describe": ("Describe the image.", "What do you see?"),
}


def answer(kind: str, spec: FrameSpec) -> str:
    """The reply stage 2 teaches, for each kind of question."""
    n, plural = spec.count, "s" if spec.count > 1 else ""
    if kind == "colour":
        return f"It is {spec.colour}."
    if kind == "shape":
        return f"They are {spec.shape}s." if n > 1 else f"It is a {spec.shape}."
    if kind == "count":
        verb = "are" if n > 1 else "is"
        return f"There {verb} {COUNT_WORDS[n]} {spec.shape}{plural}."
    article = COUNT_WORDS[n].capitalize() if n > 1 else "A"
    return f"{article} {spec.colour} {spec.shape}{plural} on a {spec.background} background."


def _turn(n_tokens: int, question: str) -> str:
    # As realtime.engine_session.render_chunk renders a frame chunk.
    pads = "<|image_pad|>" * n_tokens
    return (
        f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def lm_batch(items: list[Any], rng: random.Random, tok: Any) -> dict[str, Any]:
    """Token ids, labels (the answer only) and images for a batch of one- or two-frame chats.
    A two-frame chat asks about the second frame after a first answered turn, so the model
    learns to answer about the latest frame of a session."""
    import torch

    seqs, labels, pixels, grids = [], [], [], []
    for group in items:
        instr = rng.choice(INSTRUCTIONS)
        prefix = f"<|im_start|>system\n{instr}<|im_end|>\n" if instr else ""
        text = prefix
        for i, (pv, grid, _tgt, spec) in enumerate(group):
            kind = rng.choice(list(QUESTIONS))
            n_tokens = int(grid.prod()) // (MERGE_SIZE**2)
            text += _turn(n_tokens, rng.choice(QUESTIONS[kind]))
            pixels.append(pv)
            grids.append(grid)
            if i < len(group) - 1:
                text += answer(kind, spec) + "<|im_end|>\n"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ans = tok(answer(kind, spec) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        seqs.append(ids + ans)
        labels.append([-100] * len(ids) + ans)
    width = max(len(x) for x in seqs)
    pad = tok.pad_token_id or 0
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in seqs])
    return {
        "input_ids": input_ids,
        "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs]),
        "pixel_values": torch.cat(pixels).to(torch.float32),
        "image_grid_thw": torch.stack(grids),
    }


def train_embeddings(
    model: Any,
    data: list[Any],
    scale: float,
    *,
    steps: int,
    batch: int,
    seed: int,
    device: str = "cpu",
    lr: float = 2e-3,
    candidates: Any | None = None,
    ce_weight: float = 0.0,
) -> list[tuple[int, float]]:
    """Stage 1: fit each merged patch to its target (mean squared error). With `candidates`
    (every vector a target can be) and `ce_weight`, also a cross-entropy over the candidates with
    logits -distance²: it spends the gradient on what tells the targets apart (the shape words
    differ far less than the loss that the colours carry), not only on distance."""
    import torch

    model.to(device)
    table = sharp = None
    if candidates is not None and ce_weight:
        table = candidates.to(device, torch.float32) / scale
        gaps = torch.cdist(table, table).pow(2) / table.shape[1]
        gaps.fill_diagonal_(float("inf"))
        sharp = 5.0 / float(gaps.min())  # the nearest wrong candidate 5 nats below the right one

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    log = []
    t0 = time.perf_counter()
    for step in range(steps):
        items = rng.sample(data, batch)
        pv = torch.cat([x[0] for x in items]).to(device, torch.float32)
        grid = torch.stack([x[1] for x in items]).to(device)
        tgt = torch.cat([x[2] for x in items]).to(device)
        pred = model(pv, grid_thw=grid).pooler_output
        loss = torch.nn.functional.mse_loss(pred / scale, tgt / scale)
        if table is not None and sharp is not None:
            right = torch.cdist(tgt / scale, table).argmin(-1)
            logits = -torch.cdist(pred / scale, table).pow(2) / table.shape[1] * sharp
            loss = loss + ce_weight * torch.nn.functional.cross_entropy(logits, right)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log.append((step, float(loss.detach())))
            print(f"stage 1 step {step} loss {log[-1][1]:.4f} {time.perf_counter() - t0:.0f}s")
    return log


def train_through_lm(
    model: Any, data: list[Any], smollm2_dir: Path, *, steps: int, batch: int, seed: int
) -> list[tuple[int, float]]:
    """Stage 2: the frozen language model's loss on the answers, back-propagated to the tower
    only (the language model's weights never change)."""
    import tempfile

    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from realtime.models.smol_vlm import build_smol_vlm

    with tempfile.TemporaryDirectory() as tmp:
        build_smol_vlm(Path(tmp), smollm2_dir, vision_weights=Path(tmp) / "none")
        vlm = Qwen2VLForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(tmp)
    vlm.eval()
    for p in vlm.parameters():
        p.requires_grad_(False)
    vlm.model.visual = model
    model.train()
    pad_id = tok.convert_tokens_to_ids("<|image_pad|>")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    log = []
    t0 = time.perf_counter()
    for step in range(steps):
        groups = [rng.sample(data, 2 if rng.random() < 0.25 else 1) for _ in range(batch)]
        b = lm_batch(groups, rng, tok)
        out = vlm(**b, mm_token_type_ids=(b["input_ids"] == pad_id).long())
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            log.append((step, float(out.loss.detach())))
            print(f"stage 2 step {step} loss {log[-1][1]:.4f} {time.perf_counter() - t0:.0f}s")
    return log


def train(
    smollm2_dir: Path,
    out: Path,
    *,
    steps: int,
    lm_steps: int,
    batch: int,
    lm_batch_size: int,
    n_train: int,
    seed: int = 0,
    init: Path | None = None,
    layout: str = "sum",
    workers: int = 0,
    ce_weight: float = 0.0,
    object_coverage: float = OBJECT_COVERAGE,
    resume: Path | None = None,
    lr: float = 2e-3,
) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file, save_file

    from realtime.models.smol_vlm import vision_model

    torch.manual_seed(seed)
    emb, tok = word_embeddings(smollm2_dir)
    t0 = time.perf_counter()
    targets = Targets(emb, tok, layout=layout, object_coverage=object_coverage)
    data = make_dataset(n_train, seed, targets, workers)
    info: dict[str, Any] = {"data_s": time.perf_counter() - t0}
    weights = None
    if init is not None or resume is not None:
        start = init if init is not None else resume
        weights = {k: v.to(torch.float32) for k, v in load_file(str(start)).items()}
    model = vision_model(weights)
    model.train()
    t1 = time.perf_counter()
    if init is None:
        info["stage1_loss"] = train_embeddings(
            model,
            data,
            float(emb.std()),
            steps=steps,
            batch=batch,
            seed=seed + 1,
            candidates=targets.candidates()[1],
            ce_weight=ce_weight,
            lr=lr,
        )
    info["stage1_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    if lm_steps:
        info["stage2_loss"] = train_through_lm(
            model, data, smollm2_dir, steps=lm_steps, batch=lm_batch_size, seed=seed + 2
        )
    info["stage2_s"] = time.perf_counter() - t2
    held = make_dataset(300, 7_777, targets, workers)  # a seed the training never uses
    info["held_out"] = nearest_target_accuracy(model, held, targets)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "pt",
        "steps": str(steps),
        "lm_steps": str(lm_steps),
        "seed": str(seed),
        "layout": layout,
        "ce_weight": str(ce_weight),
        "object_coverage": str(object_coverage),
        "resumed_from": resume.name if resume is not None else "",
        "lr": str(lr),
    }
    save_file(state, str(out), metadata=meta)
    info["params"] = sum(p.numel() for p in model.parameters())
    return info


def train_codes(
    codes_path: Path,
    out: Path,
    *,
    steps: int,
    batch: int,
    n_train: int,
    seed: int = 0,
    device: str = "cpu",
    workers: int = 0,
    lr: float = 2e-3,
    resume: Path | None = None,
) -> dict[str, Any]:
    """Stage 1 towards reading codes (`vision_codes.py`): every merged patch of a frame is fitted
    to its codes in the layout they were tuned for: the sum of its colour, shape, count and
    background codes ("sum"), or attribute j mod 4's code at patch j ("place", the shipped
    tower's, docs/history/vlm-2026.md "Session 15")."""
    import torch
    from safetensors.torch import load_file, save_file

    from realtime.models.smol_vlm import vision_model
    from training.vision_codes import codes_layout

    torch.manual_seed(seed)
    codes = load_file(str(codes_path))
    targets = Targets(None, None, codes)
    targets.codes_layout = codes_layout(codes_path)
    t0 = time.perf_counter()
    data = make_dataset(n_train, seed, targets, workers)
    held = make_dataset(300, 7_777, targets, workers)  # a seed the training never uses
    info: dict[str, Any] = {"data_s": time.perf_counter() - t0}
    weights = None
    if resume is not None:  # stage 1 goes on from these weights
        weights = {k: v.to(torch.float32) for k, v in load_file(str(resume)).items()}
    model = vision_model(weights)
    model.train()
    scale = float(torch.cat([x[2] for x in data[:200]]).std())
    t1 = time.perf_counter()
    info["stage1_loss"] = train_embeddings(
        model, data, scale, steps=steps, batch=batch, seed=seed + 1, device=device, lr=lr
    )
    info["stage1_s"] = time.perf_counter() - t1
    info["held_out"] = nearest_code_accuracy(model, held, codes, device, targets.codes_layout)
    state = {
        k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "steps": str(steps), "seed": str(seed), "codes": codes_path.name}
    save_file(state, str(out), metadata=meta)
    info["params"] = sum(p.numel() for p in model.parameters())
    return info


def nearest_code_accuracy(
    model: Any, data: list[Any], codes: dict[str, Any], device: str = "cpu", layout: str = "sum"
) -> dict[str, float]:
    """Tower alone: "sum", the frame's mean patch output decoded to the nearest code sum (all
    colour/shape/count/background combinations); "place", each attribute's slots (j mod 4)
    averaged and decoded to that attribute's nearest code. Per-attribute accuracy."""
    import torch

    from training.vision_codes import ATTRIBUTES, PARTS, all_specs, fact, frame_vectors

    specs = all_specs()
    table = frame_vectors(codes, specs).to(device)
    hits = {"colour": 0, "shape": 0, "count": 0, "background": 0}
    model.eval()
    with torch.no_grad():
        for pv, grid, _tgt, spec in data:
            out = model(pv.to(device, torch.float32), grid_thw=grid[None].to(device)).pooler_output
            if layout == "place":
                for k, a in enumerate(PARTS):
                    mean = out[k :: len(PARTS)].mean(0)
                    best_i = int((codes[a].to(device) - mean).norm(dim=-1).argmin())
                    hits[a] += ATTRIBUTES[a][best_i] == fact(a, spec)
                continue
            best = specs[int((table - out.mean(0)).norm(dim=-1).argmin())]
            for a in hits:
                hits[a] += getattr(best, a) == getattr(spec, a)
    model.train()
    return {a: h / len(data) for a, h in hits.items()}


def nearest_target_accuracy(model: Any, data: list[Any], targets: Targets) -> dict[str, Any]:
    """Tower alone, any word layout: each merged patch decoded to its nearest candidate target
    (`Targets.candidates`). A frame's colour is the one most object patches name, its shape the
    one most sums and shape words name (a plural shape word means more than one), and on a
    coloured background its background the colour most background patches name. Accuracy per
    fact, on white/black and on coloured backgrounds."""
    from collections import Counter

    import torch

    from training.synth_frames import COLOURS, SHAPES

    names, table = targets.candidates()
    groups: dict[str, Counter[str]] = {"neutral": Counter(), "coloured": Counter()}
    model.eval()
    with torch.no_grad():
        for pv, grid, _tgt, spec in data:
            out = model(pv.to(torch.float32), grid_thw=grid[None]).pooler_output
            named = [names[int(i)] for i in torch.cdist(out, table).argmin(-1)]
            sums = Counter(n[0] for n in named if len(n) == 2)
            singles = Counter(n[0] for n in named if len(n) == 1 and n[0] in COLOURS)
            shapes = Counter(n[-1] for n in named if n[-1].rstrip("s") in SHAPES)
            # "sum": colour + shape on the object, the background word alone; word layouts:
            # the colour alone on the object, the background word in the sums.
            objects, grounds = (sums, singles) if targets.layout == "sum" else (singles, sums)
            colour = (objects or grounds or Counter([""])).most_common(1)[0][0]
            shape = (shapes or Counter([""])).most_common(1)[0][0]
            g = groups["neutral" if spec.background in NEUTRAL_BACKGROUNDS else "coloured"]
            g["n"] += 1
            g["colour"] += colour == spec.colour
            g["shape"] += shape.rstrip("s") == spec.shape
            g["several"] += shape.endswith("s") == (spec.count > 1)
            g["background"] += (grounds or Counter([""])).most_common(1)[0][0] == spec.background
    model.train()
    result: dict[str, Any] = {}
    for name, g in groups.items():
        n = max(1, g.pop("n", 0))
        result[name] = {"n": n, **{k: round(v / n, 3) for k, v in g.items()}}
    return result


def main() -> None:
    from realtime.models import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=450, help="stage 1 steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--lm-steps",
        type=int,
        default=0,
        help="stage 2 steps (experimental, see docs/history/vlm-2026.md)",
    )
    ap.add_argument("--lm-batch", type=int, default=8)
    ap.add_argument("--frames", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path, help="skip stage 1: start from these weights")
    ap.add_argument("--resume", type=Path, help="run stage 1 on from these weights")
    ap.add_argument("--codes", type=Path, help="fit the reading codes (vision_codes.py)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--layout", choices=LAYOUTS, default="sum", help="stage 1 target layout")
    ap.add_argument(
        "--ce-weight", type=float, default=0.0, help="stage 1 nearest-target cross-entropy weight"
    )
    ap.add_argument(
        "--object-coverage",
        type=float,
        default=OBJECT_COVERAGE,
        help="a merged patch at least this much covered by shapes gets the object's word",
    )
    args = ap.parse_args()
    if args.codes is not None:
        info = train_codes(
            args.codes,
            args.out,
            steps=args.steps,
            batch=args.batch,
            n_train=args.frames,
            seed=args.seed,
            device=args.device,
            workers=args.workers,
            lr=args.lr,
            resume=args.resume,
        )
        print(json.dumps(info))
        return
    src = build_model("smollm2-135m-instruct")
    info = train(
        src,
        args.out,
        steps=args.steps,
        lm_steps=args.lm_steps,
        batch=args.batch,
        lm_batch_size=args.lm_batch,
        n_train=args.frames,
        seed=args.seed,
        init=args.init,
        layout=args.layout,
        workers=args.workers,
        ce_weight=args.ce_weight,
        object_coverage=args.object_coverage,
        resume=args.resume,
        lr=args.lr,
    )
    print(json.dumps(info))


if __name__ == "__main__":
    main()
