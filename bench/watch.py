"""Watch and ask (issue #19): what an ingested frame (`reply: false`) costs against an answered one.

    python -m bench.watch --model tiny-qwen2-vl --json docs/bench/watch-vlm.json
    python -m bench.watch --model smollm2-135m-instruct --json docs/bench/watch-smollm2.json

Chunks go through the server's own per-chunk path (`render_chunk`, `EngineSession.chunk_params`,
`EngineSession.run_chunk`) into one bounded streaming session (the server's default retention:
the first chunk pinned, a window of 8), without the WebSocket. Phase 1, one session: chunks
alternate ingested / answered (max_tokens 16, EOS ignored so every answer is exactly 16 tokens,
greedy); per chunk the wall latency (chunk queued to its boundary) and the engine time: the wall
time of every engine step that scheduled the session (from `schedule()` to the end of
`update_from_output()`, measured in EngineCore by `bench.engine_timing.TimedScheduler`; alone on the
engine, so a step is the session's). Phase 2: the sustained ingest rate, 1 and 8 sessions
ingesting frames back to back (frames/s over all sessions). Frames are 112×112 JPEGs (16 LLM
tokens, ~36 with the template) on the tiny VLM, and ~20-token text lines on SmolLM2.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench.engine_timing import SCHEDULER_CLS, busy_ns


def jpeg(seed: int, size: int = 112) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=80)
    return buf.getvalue()


class Session:
    def __init__(self, engine: Any, multimodal: bool, max_tokens: int) -> None:
        from realtime.engine_session import EngineSession, chat_format_of
        from vllm_realtime_protocol import SamplingConfig, SessionConfig

        self.es = EngineSession(
            engine,
            f"watch-{uuid.uuid4().hex[:12]}",
            SamplingConfig(max_tokens=max_tokens, temperature=0.0),
            {"sink_chunks": 1, "window_chunks": 8},
            ignore_eos=True,
        )
        self.multimodal = multimodal
        self.chat = chat_format_of(engine)
        self.config = SessionConfig(
            modality="video" if multimodal else "text",
            instructions="You watch a camera. Answer in one short sentence.",
        )
        self.sent = 0

    def frame(self, reply: bool) -> Any:
        from vllm_realtime_protocol import Frame

        i = self.sent
        if self.multimodal:
            data = jpeg(i % 16)
            return Frame(i, None, "image", "jpeg", data, None, None, None, reply=reply)
        text = f"Frame {i}: the hallway is empty; the door on the left is closed."
        return Frame(i, None, "text", None, text.encode(), text, None, None, reply=reply)

    async def run(self, reply: bool) -> dict[str, float]:
        from realtime.engine_session import ChunkFinished, render_chunk

        frame = self.frame(reply)
        prompt = await asyncio.to_thread(
            render_chunk,
            frame,
            self.config,
            chat=self.chat,
            first=self.es.chunks == 0,
            multimodal=self.multimodal,
            after_reply=self.es.turn_open,
        )
        params = self.es.chunk_params(reply=reply, kind="frame")
        started = time.perf_counter()
        result: dict[str, float] = {}
        async for item in self.es.run_chunk(prompt, params, reply=reply):
            if isinstance(item, ChunkFinished):
                result = {
                    "latency_ms": (time.perf_counter() - started) * 1e3,
                    "completion_tokens": item.completion_tokens,
                    "prompt_tokens": item.prompt_tokens,
                }
        self.sent += 1
        return result


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 2),
        "p50": round(statistics.median(values), 2),
        "n": len(values),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from realtime.engine import EngineSettings, start_engine

    extra: dict[str, Any] = {"scheduler_cls": SCHEDULER_CLS}
    multimodal = args.model != "smollm2-135m-instruct"
    if multimodal:
        extra["limit_mm_per_prompt"] = {"image": 1, "video": 1}
    engine = start_engine(
        EngineSettings(
            model=args.model,
            max_model_len=2048,
            kv_cache_memory_bytes=args.kv_mib << 20,
            block_size=32,
            max_num_seqs=16,
            dtype="float32",
            extra=extra,
        )
    )
    try:
        # Phase 1: one session, alternating ingested / answered.
        s = Session(engine, multimodal, args.max_tokens)
        rows: list[dict[str, Any]] = []
        for i in range(args.chunks):
            reply = i % 2 == 1
            before = await busy_ns(engine, s.es.request_id)
            r = await s.run(reply)
            r["engine_ms"] = (await busy_ns(engine, s.es.request_id) - before) / 1e6
            r["reply"] = reply
            rows.append(r)
        await s.es.abort()
        measured = rows[args.warmup :]
        phase1: dict[str, Any] = {}
        for name, reply in (("ingested", False), ("answered", True)):
            sel = [r for r in measured if r["reply"] == reply]
            phase1[name] = {
                "latency_ms": _summary([r["latency_ms"] for r in sel]),
                "engine_ms": _summary([r["engine_ms"] for r in sel]),
                "completion_tokens": _summary([r["completion_tokens"] for r in sel]),
            }
        phase1["ratio_latency_p50"] = round(
            phase1["ingested"]["latency_ms"]["p50"] / phase1["answered"]["latency_ms"]["p50"], 3
        )
        phase1["ratio_engine_p50"] = round(
            phase1["ingested"]["engine_ms"]["p50"] / phase1["answered"]["engine_ms"]["p50"], 3
        )

        # Phase 2: sustained ingest rate.
        rates: dict[str, Any] = {}
        for n in args.sessions:
            sessions = [Session(engine, multimodal, args.max_tokens) for _ in range(n)]
            for sess in sessions:  # the first chunk (instructions) outside the timing
                await sess.run(False)

            async def ingest(sess: Session) -> None:
                for _ in range(args.ingest_frames):
                    await sess.run(False)

            started = time.perf_counter()
            await asyncio.gather(*(ingest(sess) for sess in sessions))
            wall = time.perf_counter() - started
            for sess in sessions:
                await sess.es.abort()
            frames = n * args.ingest_frames
            rates[str(n)] = {
                "frames": frames,
                "wall_s": round(wall, 2),
                "frames_per_s": round(frames / wall, 2),
            }
        return {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "chunks": args.chunks,
            "warmup": args.warmup,
            "kv_mib": args.kv_mib,
            "phase1": phase1,
            "ingest_rate": rates,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2-vl")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--chunks", type=int, default=64, help="phase 1 chunks (half answered)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ingest-frames", type=int, default=24, help="phase 2 frames per session")
    p.add_argument("--kv-mib", type=int, default=128, help="KV cache size (SmolLM2 needs ~96)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
