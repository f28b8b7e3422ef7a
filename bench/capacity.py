"""Capacity: how many bounded sessions one engine admits, against how many physically fit.

    .venv/bin/python -m bench.capacity --chunks 100 --json docs/bench/capacity.json

Through the real server (uvicorn on loopback, WebSocket clients, real vLLM; SmolLM2-135M,
max_model_len 2048, the server's default KV size): open bounded text sessions with one budget
until `capacity_exceeded`, then run all admitted sessions at once for `--chunks` chunks each,
every chunk at the largest size the server allows (limits.max_chunk_tokens, template
included) and every reply up to max_tokens. Reported:

* admitted: sessions the new admission (realtime/admission.py) let in, and what the old rule
  (ceil(max_model_len / block) + 1 per session) admits on the same pool;
* physical fit: pool / the peak blocks one session was measured to hold (from
  response.done.retention.kv_blocks_held, and EngineCore at the end);
* preemptions (engine-side counter of every session), stalls (a chunk that failed or took
  longer than `--stall-s`), blocks leaked after every session closed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.soak import serve

SUBPROTOCOLS = ["vllm-realtime"]


def _budget(args: argparse.Namespace) -> dict[str, Any]:
    return {"sink_chunks": 1, "window_chunks": args.window}


async def _recv(ws: Any) -> dict[str, Any]:
    return dict(json.loads(await ws.recv()))


def _max_size_text(hub: Any, cap: int) -> str:
    """A text turn whose rendered chunk (template included) is as close to the cap as fits."""
    words = ["river", "mill", "boat", "stone", "light", "field", "bridge", "cloud"]
    text = ""
    i = 0
    while True:
        candidate = (text + " " + words[i % len(words)]).strip()
        rendered = f"<|im_end|>\n<|im_start|>user\n{candidate}<|im_end|>\n<|im_start|>assistant\n"
        if hub.count_tokens(rendered) > cap:
            return text
        text = candidate
        i += 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    from realtime.engine import EngineSettings
    from retention.vllm_adapter.introspect import kv_stats, retention_state

    settings = EngineSettings(
        model="smollm2-135m-instruct",
        max_model_len=2048,
        dtype="float32",
        max_num_seqs=256,
        block_size=args.block_size,
    )
    async with serve(settings, "smollm2-135m-instruct", max_sessions=1000) as srv:
        hub = srv["hub"]
        engine = srv["engine"]
        pool = hub.usable_blocks
        old_rule = math.ceil(hub.max_model_len / hub.block_size) + 1
        config = {
            "type": "session.open",
            "modality": "text",
            "retention": _budget(args),
            "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
        }
        sockets: list[Any] = []
        reservation: dict[str, Any] | None = None
        refusal = ""
        while True:
            ws = await websockets.connect(srv["url"], subprotocols=SUBPROTOCOLS, max_size=None)
            await _recv(ws)
            await ws.send(json.dumps(config))
            reply = await _recv(ws)
            if reply["type"] != "session.opened":
                refusal = reply["error"]["message"]
                await ws.close()
                break
            reservation = reply["reservation"]
            sockets.append(ws)
        text = _max_size_text(hub, hub.config.max_chunk_tokens - 4)  # room for the turn number
        peaks = [0] * len(sockets)
        stalls = 0
        latencies: list[float] = []

        async def drive(i: int, ws: Any) -> None:
            nonlocal stalls
            for n in range(args.chunks):
                t0 = time.perf_counter()
                await ws.send(json.dumps({"type": "frame.append", "text": f"{n} {text}"}))
                while True:
                    event = await asyncio.wait_for(_recv(ws), args.stall_s * 4)
                    if event["type"] == "response.done":
                        break
                    if event["type"] == "error":
                        stalls += 1
                        return
                dt = time.perf_counter() - t0
                latencies.append(dt)
                if event["status"] not in ("completed", "incomplete") or dt > args.stall_s:
                    stalls += 1
                peaks[i] = max(peaks[i], int(event["retention"]["kv_blocks_held"]))

        started = time.perf_counter()
        await asyncio.gather(*(drive(i, ws) for i, ws in enumerate(sockets)))
        elapsed = time.perf_counter() - started
        preemptions = 0
        for sid in list(hub.sessions):
            state = await retention_state(engine, sid)
            if state is not None:
                preemptions += int(state["preemptions"])
        for ws in sockets:
            await ws.close()
        for _ in range(200):
            if not hub.sessions and (await kv_stats(engine))["num_free_blocks"] == pool:
                break
            await asyncio.sleep(0.1)
        free = (await kv_stats(engine))["num_free_blocks"]
        peak = max(peaks) if peaks else 0
        physical_fit = pool // peak if peak else 0
        admitted = len(sockets)
        return {
            "model": "smollm2-135m-instruct",
            "max_model_len": hub.max_model_len,
            "pool_blocks": pool,
            "block_size": hub.block_size,
            "budget": _budget(args),
            "max_tokens": args.max_tokens,
            "max_chunk_tokens": hub.config.max_chunk_tokens,
            "chunk_text_tokens": hub.count_tokens(text),
            "chunks_per_session": args.chunks,
            "reservation": reservation,
            "admitted": admitted,
            "admitted_old_rule": pool // old_rule,
            "refusal": refusal,
            "peak_blocks_per_session": peak,
            "physical_fit": physical_fit,
            "admitted_over_physical_fit": round(admitted / physical_fit, 3)
            if physical_fit
            else None,
            "preemptions": preemptions,
            "stalls": stalls,
            "blocks_leaked": pool - free,
            "elapsed_s": round(elapsed, 1),
            "chunk_latency_p50_s": round(sorted(latencies)[len(latencies) // 2], 3)
            if latencies
            else None,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--window", type=int, default=4, help="window_chunks of every session")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size (default: vLLM's for the device)",
    )
    parser.add_argument("--stall-s", type=float, default=120.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    out = json.dumps(result, indent=2)
    print(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(out + "\n")


if __name__ == "__main__":
    main()
