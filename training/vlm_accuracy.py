"""Does `smol-qwen2-vl` read frames? Accuracy on held-out synthetic frames, through vLLM.

Each frame (drawn with a seed the training never used, sent as JPEG like a client's) is asked
three questions in one-turn requests rendered exactly as the server renders a frame chunk (the
session instructions as system turn, the image, the question). A reply is right when it names the
fact: the shapes' colour, their kind ("circle"/"circles"), their number ("two" or "2"). Also asks
Chromium's fake-camera frame to be described.

    python -m training.vlm_accuracy --frames 500 --out docs/bench/vlm_accuracy.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

from training.synth_frames import COUNT_WORDS, FrameSpec, draw_frame, random_spec

MODEL = "smol-qwen2-vl"
# The LM reads a frame as superposed word embeddings; telling it so helps (measured on 100
# frames: colour named 42% → 63% on plain backgrounds).
INSTRUCTIONS = (
    "You are a vision assistant. The picture is given as words. Reply with one short sentence "
    "naming the colour and the shape."
)
QUESTIONS = {
    "colour": "What colour is it?",
    "shape": "What is the shape?",
    "count": "How many shapes are there?",
}
DESCRIBE = "Describe the image."
EVAL_SEED = 20_240_601  # training uses seeds 0 and 1


def named(kind: str, spec: FrameSpec, reply: str) -> bool:
    text = reply.lower()
    if kind == "colour":
        return spec.colour in text
    if kind == "shape":
        return spec.shape in text
    return COUNT_WORDS[spec.count] in text.split() or str(spec.count) in text


def named_only(kind: str, spec: FrameSpec, reply: str) -> bool:
    """Strict: the reply names the fact and no other value of it ("a square is a circle" names
    two shapes; `named` counts it, this does not)."""
    from training.synth_frames import COLOURS, SHAPES

    if not named(kind, spec, reply):
        return False
    words = reply.lower().replace(".", " ").replace(",", " ").split()
    if kind == "colour":
        return not any(c in words for c in COLOURS if c != spec.colour)
    if kind == "shape":
        return not any(w.rstrip("s") in SHAPES and w.rstrip("s") != spec.shape for w in words)
    others = [w for n, w in COUNT_WORDS.items() if n != spec.count] + [
        str(n) for n in range(10) if n != spec.count
    ]
    return not any(w in words for w in others)


def prompt_for(
    image: Any, question: str, instructions: str | None = INSTRUCTIONS
) -> dict[str, Any]:
    """The server's rendering of a first frame chunk (realtime.engine_session.render_chunk)."""
    from realtime.engine_session import render_chunk
    from realtime.models import DEFAULT_MODELS
    from vllm_realtime_protocol import SessionConfig
    from vllm_realtime_protocol.state import Frame

    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    frame = Frame(
        frame_index=0,
        frame_id="f0",
        kind="image",
        media_format="jpeg",
        data=buf.getvalue(),
        text=None,
        prompt=question,
        timestamp=None,
    )
    chat = DEFAULT_MODELS[MODEL].chat_format
    return render_chunk(
        frame, SessionConfig(instructions=instructions), chat=chat, first=True, multimodal=True
    )


async def ask(engine: Any, prompt: dict[str, Any], max_tokens: int = 24) -> str:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    final = None
    async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
        final = out
    assert final is not None
    return str(final.outputs[0].text)


async def run(
    engine: Any, n: int, concurrency: int = 16, instructions: str = INSTRUCTIONS
) -> dict[str, Any]:
    from training.synth_frames import pacman_frame

    rng = random.Random(EVAL_SEED)
    items = []
    for _ in range(n):
        spec = random_spec(rng)
        items.append((spec, draw_frame(spec, rng)[0]))
    sem = asyncio.Semaphore(concurrency)

    async def one(spec: FrameSpec, img: Any, kind: str) -> tuple[FrameSpec, str, str]:
        async with sem:
            prompt = prompt_for(img, QUESTIONS[kind], instructions)
            return spec, kind, await ask(engine, prompt)

    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(one(spec, img, kind) for spec, img in items for kind in QUESTIONS)
    )
    elapsed = time.perf_counter() - t0
    acc: dict[str, Any] = {}
    for kind in QUESTIONS:
        rows = [(s, r) for s, k, r in results if k == kind]
        acc[kind] = sum(named(kind, s, r) for s, r in rows) / len(rows)
        acc[kind + "_only"] = sum(named_only(kind, s, r) for s, r in rows) / len(rows)
        by_bg = {}
        for group, neutral in (("neutral_background", True), ("coloured_background", False)):
            sel = [(s, r) for s, r in rows if (s.background in ("white", "black")) == neutral]
            by_bg[group] = {
                "n": len(sel),
                "accuracy": sum(named(kind, s, r) for s, r in sel) / max(1, len(sel)),
            }
        acc[kind + "_by_background"] = by_bg
    pac = await ask(engine, prompt_for(pacman_frame(), DESCRIBE, instructions), max_tokens=32)
    pac_colour = await ask(engine, prompt_for(pacman_frame(), QUESTIONS["colour"], instructions))
    examples = [
        {"spec": s.__dict__, "question": QUESTIONS[k], "reply": r} for s, k, r in results[:24]
    ]
    replies = [[s.colour, s.shape, s.count, s.background, k, r] for s, k, r in results]
    return {
        "model": MODEL,
        "frames": n,
        "instructions": instructions,
        "questions": QUESTIONS,
        "accuracy": acc,
        "fake_camera": {"describe": pac, "colour": pac_colour, "green": "green" in pac.lower()},
        "requests": len(results),
        "seconds": elapsed,
        "examples": examples,
        "replies": replies,
    }


def main() -> None:
    import os

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=500)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--model-dir", type=Path, help="a built smol-qwen2-vl elsewhere (other tower weights)"
    )
    ap.add_argument("--instructions", default=INSTRUCTIONS)
    args = ap.parse_args()

    from realtime.engine import EngineSettings, start_engine

    engine = start_engine(
        EngineSettings(
            model=str(args.model_dir) if args.model_dir else MODEL,
            max_model_len=1024,
            kv_cache_memory_bytes=64 << 20,
            block_size=32,
            max_num_seqs=16,
            dtype="float32",
            extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
        )
    )
    try:
        report = asyncio.run(run(engine, args.frames, instructions=args.instructions))
    finally:
        engine.shutdown()
    print(
        json.dumps({k: v for k, v in report.items() if k not in ("examples", "replies")}, indent=2)
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
