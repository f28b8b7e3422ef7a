"""Video fidelity of one bounded session through the real server, on `smol-qwen2-vl`.

One WebSocket session (sink 1 chunk, window `--window` chunks) receives `--frames` synthetic JPEG
frames, each with the prompt "What colour is it?", and the server answers every frame.

* **Current-frame accuracy**: the reply names the colour of the frame it answers. Compared over
  frames 1–100 and 901–1000: after hundreds of evictions and consolidations the model must read
  the current frame as well as at the start.
* **Recall inside vs outside the window**: every `--probe-every` frames a *marker* frame shows a
  purple shape (no other frame is purple), and a few chunks later a text turn asks which colours
  the model has seen (the question names none). A probe is *near* (marker 2 chunks back: inside
  the window, its frame and the model's reply to it still in the KV) or *far* (marker
  `window + 8` chunks back: evicted). A probe scores when the reply names purple; near and far
  probes alternate. The far score is the rate of naming purple with the marker gone.

    python -m bench.vlm_fidelity --frames 1000 --out docs/bench/vlm_fidelity.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.soak import _engine_settings, _recv_until, serve
from bench.vlm_accuracy import INSTRUCTIONS, QUESTIONS
from realtime.models.synth_frames import COLOURS, FrameSpec, draw_frame

MODEL = "smol-qwen2-vl"
MARKER = "purple"
FILLER_COLOURS = [c for c in COLOURS if c != MARKER]
PROBE = "Which colours have you seen so far?"


def _jpeg(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return base64.b64encode(buf.getvalue()).decode()


def schedule(frames: int, window: int, probe_every: int) -> list[tuple[str, Any]]:
    """The session's chunks: ("frame", spec) or ("probe", "near"|"far"), deterministic."""
    rng = random.Random(7)
    far_gap = window + 8
    chunks: list[tuple[str, Any]] = []
    markers: dict[int, str] = {}  # chunk index of the probe -> near/far
    n_frames = 0
    probe_no = 0
    while n_frames < frames:
        idx = len(chunks)
        if idx in markers:
            chunks.append(("probe", markers.pop(idx)))
            continue
        spec = FrameSpec(
            rng.choice(FILLER_COLOURS),
            rng.choice(["circle", "square", "triangle"]),
            rng.randint(1, 3),
            rng.choice(["white", "black"]),
        )
        if n_frames >= 20 and n_frames % probe_every == 0:
            kind = "near" if probe_no % 2 == 0 else "far"
            probe_no += 1
            spec = FrameSpec(MARKER, spec.shape, spec.count, spec.background)
            markers[idx + (2 if kind == "near" else far_gap)] = kind
        chunks.append(("frame", spec))
        n_frames += 1
    return chunks


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    settings = _engine_settings(
        MODEL,
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
    )
    rng = random.Random(11)
    chunks = schedule(args.frames, args.window, args.probe_every)
    frame_rows: list[dict[str, Any]] = []
    probe_rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    async with (
        serve(settings, MODEL, max_sessions=2) as srv,
        websockets.connect(srv["url"], subprotocols=["vllm-realtime"]) as ws,
    ):
        await ws.recv()
        retention = {"sink_chunks": 1, "window_chunks": args.window}
        await ws.send(
            json.dumps(
                {
                    "type": "session.open",
                    "modality": "video",
                    "instructions": INSTRUCTIONS,
                    "retention": retention,
                    "sampling": {"max_tokens": args.max_tokens},
                }
            )
        )
        opened = json.loads(await ws.recv())
        assert opened["type"] == "session.opened", opened
        for n, (kind, what) in enumerate(chunks, start=1):
            if kind == "frame":
                img, _ = draw_frame(what, rng, (320, 240))
                event = {"type": "frame.append", "image": _jpeg(img), "prompt": QUESTIONS["colour"]}
            else:
                event = {"type": "frame.append", "text": PROBE}
            await ws.send(json.dumps(event))
            seen = await _recv_until(ws, "response.done")
            done = seen[-1]
            if done["status"] not in ("completed", "incomplete"):
                raise RuntimeError(f"chunk {n}: {done} {[e for e in seen if e['type'] == 'error']}")
            text = done["text"].lower()
            if kind == "frame":
                frame_rows.append(
                    {
                        "frame": len(frame_rows) + 1,
                        "colour": what.colour,
                        "right": what.colour in text,
                        "reply": done["text"],
                        "evicted": done["retention"]["frames_evicted"],
                        "consolidations": done["retention"]["consolidations"],
                        "kv_blocks": done["retention"]["kv_blocks_held"],
                    }
                )
            else:
                probe_rows.append(
                    {"chunk": n, "kind": what, "right": MARKER in text, "reply": done["text"]}
                )
            if n % 100 == 0:
                print(
                    f"chunk {n}: frames {len(frame_rows)} {time.perf_counter() - t0:.0f}s",
                    flush=True,
                )

    def acc(rows: list[dict[str, Any]]) -> float:
        return sum(r["right"] for r in rows) / max(1, len(rows))

    first, last = frame_rows[:100], frame_rows[-100:]
    near = [p for p in probe_rows if p["kind"] == "near"]
    far = [p for p in probe_rows if p["kind"] == "far"]
    return {
        "model": MODEL,
        "frames": len(frame_rows),
        "window_chunks": args.window,
        "sink_chunks": 1,
        "frame_prompt": QUESTIONS["colour"],
        "probe": PROBE,
        "current_frame_accuracy": {
            "frames_1_100": acc(first),
            "last_100": acc(last),
            "all": acc(frame_rows),
            "difference_points": 100 * (acc(last) - acc(first)),
        },
        "recall": {
            "near_probes": len(near),
            "near_named_marker": acc(near),
            "far_probes": len(far),
            "far_named_marker": acc(far),
        },
        "evicted_frames_at_end": frame_rows[-1]["evicted"],
        "consolidations_at_end": frame_rows[-1]["consolidations"],
        "kv_blocks_at_end": frame_rows[-1]["kv_blocks"],
        "seconds": time.perf_counter() - t0,
        "probes": probe_rows,
        "frames_sample": frame_rows[:5] + frame_rows[-5:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--probe-every", type=int, default=25)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    report = asyncio.run(run(args))
    print(
        json.dumps(
            {k: v for k, v in report.items() if k not in ("probes", "frames_sample")}, indent=2
        )
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
