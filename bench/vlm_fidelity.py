"""Video fidelity of one bounded session through the real server, on `smol-qwen2-vl`.

One WebSocket session (sink 1 chunk, window `--window` chunks) receives `--frames` synthetic JPEG
frames. Every `--ask-every`-th frame (default 2; and every marker frame) carries a question and
is answered; the others are ingested (`reply: false`), as a watching client sends them. By
default the question is "Describe the image." and the reply is constrained to the descriptions
the model was tuned on (`--reply-format describe`; session 17: asked of every frame in free
text, the 135M LM falls into repeating one reply after ~100-300 frames, docs/history/vlm-2026.md).

* **Sink** (`--sink`): `instructions` (default) opens with an ingested text turn, so the pinned
  chunk holds the instructions only; `frame` pins the first frame and its reply. A small LM
  copies a pinned reply into every later one (measured: "The colour is blue." for frame 1 was
  repeated by most later frames), so the default keeps replies out of the sink.
* **Current-frame accuracy**: the reply names the colour of the frame it answers. Compared over
  the first and the last 100 frames, and paired: the last 100 frames replay the first 100
  (same specs, same pixels, same asked/ingested pattern), so the difference measures what 900
  frames of evictions and consolidations changed, not which frames were drawn (unpaired, two
  samples of 100 differ by ~7 points by chance alone).
* **Recall inside vs outside the window**: every `--probe-every` frames a *marker* frame shows a
  purple shape (no other frame is purple), and later a text turn asks which colours the model
  has seen (the question names none). A probe is *near* (marker `--near-gap` chunks back,
  default 1: the chunk before the probe, inside the window, its frame and the model's reply to
  it still in the KV) or *far* (marker `window + 8` chunks back: evicted). A probe scores when
  the reply names purple; near and far probes alternate. The far score is the rate of naming
  purple with the marker gone. The 135M LM answers a probe in its frames' reply format, naming
  one colour: the last frame's, or the one its last replies named (session 16: 0/19 with the
  marker 2 chunks back).
* **Reply format** (`--reply-format`): free text, or constrained by the session's
  `response_format` to the sentences the codes were tuned on (`reply_format`).

    python -m bench.vlm_fidelity --frames 1000 --out docs/bench/vlm_fidelity.json
    python -m bench.vlm_fidelity --ask-every 1 --reply-format free --max-tokens 8   # the hardest
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
from training.synth_frames import COLOURS, FrameSpec, draw_frame
from training.vlm_accuracy import DESCRIBE, INSTRUCTIONS, QUESTIONS

MODEL = "smol-qwen2-vl"
MARKER = "purple"
FILLER_COLOURS = [c for c in COLOURS if c != MARKER]
PROBE = "Which colours have you seen so far?"
SINK_TEXT = "Pictures follow, one at a time."


def _jpeg(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return base64.b64encode(buf.getvalue()).decode()


PAIRED = 100  # the last PAIRED frames replay the first PAIRED


def schedule(
    frames: int, window: int, probe_every: int, near_gap: int = 1
) -> list[tuple[str, Any]]:
    """The session's chunks: ("frame", (n, spec, pixel seed)) or ("probe", "near"|"far"),
    deterministic. With `frames` >= 2 * PAIRED, frame n of the last PAIRED replays frame
    n - (frames - PAIRED): same spec, same pixel seed (markers included)."""
    rng = random.Random(7)
    far_gap = window + 8
    replay_from = frames - PAIRED if frames >= 2 * PAIRED else frames
    chunks: list[tuple[str, Any]] = []
    drawn: list[tuple[FrameSpec, int]] = []
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
        seed = rng.randrange(1 << 30)
        if n_frames >= replay_from:
            spec, seed = drawn[n_frames - replay_from]
        elif n_frames >= 20 and n_frames % probe_every == 0:
            spec = FrameSpec(MARKER, spec.shape, spec.count, spec.background)
        if spec.colour == MARKER:
            kind = "near" if probe_no % 2 == 0 else "far"
            probe_no += 1
            markers[idx + (near_gap if kind == "near" else far_gap)] = kind
        drawn.append((spec, seed))
        chunks.append(("frame", (n_frames, spec, seed)))
        n_frames += 1
    return chunks


def reply_format(kind: str) -> dict[str, Any]:
    """`free`: free text. `sentence`: every reply (probes too) is one of the sentences the codes
    were tuned on, "The colour is <c>.", as a JSON string (the session's response_format): the
    reply's form is fixed, so what is measured is whether the colour word is read or copied,
    not whether a 135M LM keeps its format over 1,000 replies. `describe`: the frames are asked
    "Describe the image." and every reply is one of the tuned descriptions ("Two red circles on
    a white background."): a copied reply is then wrong in more places than the colour."""
    if kind == "free":
        return {}
    if kind == "describe":  # every tuned description: colour, shape, count and background
        from training.page_formats import describe_format

        return {"response_format": describe_format()}  # what the demo page sends by default
    sentences = [f"The colour is {c}." for c in COLOURS]
    schema = {"type": "string", "enum": sentences}
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"tuned_{kind}", "schema": schema},
        }
    }


def frame_prompt(reply_format: str) -> str:
    return DESCRIBE if reply_format == "describe" else QUESTIONS["colour"]


async def _open(ws: Any, args: argparse.Namespace) -> None:
    """Open the video session (and send the instructions' sink chunk when asked)."""
    await ws.recv()
    retention = {"sink_chunks": 1, "window_chunks": args.window}
    await ws.send(
        json.dumps(
            {
                "type": "session.open",
                "modality": "video",
                "instructions": INSTRUCTIONS,
                "retention": retention,
                "sampling": {"max_tokens": args.max_tokens} | reply_format(args.reply_format),
            }
        )
    )
    opened = json.loads(await ws.recv())
    assert opened["type"] == "session.opened", opened
    if args.sink == "instructions":
        await ws.send(json.dumps({"type": "frame.append", "text": SINK_TEXT, "reply": False}))
        done = (await _recv_until(ws, "response.done"))[-1]
        assert done["status"] == "ingested", done


async def _chunk(
    ws: Any, args: argparse.Namespace, n: int, kind: str, what: Any
) -> tuple[str, dict[str, Any]]:
    """Send chunk `n` (a drawn frame, asked or not, or a recall probe); its record."""
    asked = True
    if kind == "frame":
        n_frame, spec, seed = what
        img, _ = draw_frame(spec, random.Random(seed), (320, 240))
        asked = spec.colour == MARKER or n_frame % args.ask_every == 0
        event = {"type": "frame.append", "image": _jpeg(img)}
        if asked:
            event["prompt"] = frame_prompt(args.reply_format)
        else:
            event["reply"] = False
    else:
        event = {"type": "frame.append", "text": PROBE}
    await ws.send(json.dumps(event))
    seen = await _recv_until(ws, "response.done")
    done = seen[-1]
    if done["status"] not in ("completed", "incomplete", "ingested"):
        raise RuntimeError(f"chunk {n}: {done} {[e for e in seen if e['type'] == 'error']}")
    text = (done.get("text") or "").lower()
    if kind == "frame":
        return "frame", {
            "frame": n_frame + 1,
            "asked": asked,
            "colour": spec.colour,
            "right": spec.colour in text,
            "reply": done.get("text"),
            "evicted": done["retention"]["frames_evicted"],
            "consolidations": done["retention"]["consolidations"],
            "kv_blocks": done["retention"]["kv_blocks_held"],
        }
    return "probe", {
        "chunk": n,
        "kind": what,
        "asked": True,
        "right": MARKER in text,
        "reply": done["text"],
    }


def _summary(
    args: argparse.Namespace,
    frame_rows: list[dict[str, Any]],
    probe_rows: list[dict[str, Any]],
    t0: float,
) -> dict[str, Any]:
    """Accuracy on the first and last frames, recall of the probes, the session's state at the end."""

    def acc(rows: list[dict[str, Any]]) -> float:
        rows = [r for r in rows if r["asked"]]
        return sum(r["right"] for r in rows) / max(1, len(rows))

    first, last = frame_rows[:PAIRED], frame_rows[-PAIRED:]
    paired = len(frame_rows) >= 2 * PAIRED
    same_reply = sum(
        a["reply"] == b["reply"] for a, b in zip(first, last, strict=True) if a["asked"]
    )
    near = [p for p in probe_rows if p["kind"] == "near"]
    far = [p for p in probe_rows if p["kind"] == "far"]
    return {
        "model": MODEL,
        "frames": len(frame_rows),
        "window_chunks": args.window,
        "block_size": args.block_size,
        "sink_chunks": 1,
        "sink": args.sink,
        "ask_every": args.ask_every,
        "frame_prompt": frame_prompt(args.reply_format),
        "probe": PROBE,
        "reply_format": args.reply_format,
        "max_position": args.max_position,
        "near_gap_chunks": args.near_gap,
        "far_gap_chunks": args.window + 8,
        "current_frame_accuracy": {
            "frames_1_100": acc(first),
            "last_100": acc(last),
            "all": acc(frame_rows),
            "difference_points": 100 * (acc(last) - acc(first)),
            "paired": paired,
            "asked_per_100": sum(r["asked"] for r in first),
            "same_reply_first_vs_last": same_reply if paired else None,
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
        "model_dir": args.model_dir.name if args.model_dir else None,
        "probes": probe_rows,
        "frames_sample": frame_rows[:10] + frame_rows[-10:],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    settings = _engine_settings(
        str(args.model_dir) if args.model_dir else MODEL,
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        block_size=args.block_size,
        extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
    )
    chunks = schedule(args.frames, args.window, args.probe_every, args.near_gap)
    frame_rows: list[dict[str, Any]] = []
    probe_rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    async with (
        serve(settings, MODEL, max_sessions=2, retention_max_position=args.max_position) as srv,
        websockets.connect(srv["url"], subprotocols=["vllm-realtime"]) as ws,
    ):
        await _open(ws, args)
        for n, (kind, what) in enumerate(chunks, start=1):
            which, row = await _chunk(ws, args, n, kind, what)
            (frame_rows if which == "frame" else probe_rows).append(row)
            if n % 100 == 0:
                print(
                    f"chunk {n}: frames {len(frame_rows)} {time.perf_counter() - t0:.0f}s",
                    flush=True,
                )
    if args.records:
        args.records.parent.mkdir(parents=True, exist_ok=True)
        args.records.write_text("".join(json.dumps(r) + "\n" for r in frame_rows + probe_rows))

    return _summary(args, frame_rows, probe_rows, t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--probe-every", type=int, default=25)
    ap.add_argument(
        "--near-gap",
        type=int,
        default=1,
        help="chunks from a marker to its near probe (1: the probe follows the marker)",
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--sink", choices=["instructions", "frame"], default="instructions")
    ap.add_argument(
        "--block-size", type=int, default=32, help="KV block size: eviction frees whole blocks"
    )
    ap.add_argument(
        "--ask-every",
        type=int,
        default=2,
        help="answer every k-th frame (the others are ingested, as a watching client sends them)",
    )
    ap.add_argument(
        "--reply-format",
        choices=["free", "sentence", "describe"],
        default="describe",
        help="sentence: replies constrained to 'The colour is <c>.' (a JSON string enum); "
        "describe: frames asked 'Describe the image.', replies one of the tuned descriptions",
    )
    ap.add_argument(
        "--max-position",
        type=int,
        default=None,
        help="the server's --retention-max-position (default: the model's trained range)",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--records", type=Path, help="every frame's row (JSON lines)")
    ap.add_argument(
        "--model-dir", type=Path, help="a built smol-qwen2-vl elsewhere (other tower weights)"
    )
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
