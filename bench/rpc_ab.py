"""Per-frame latency with the session report on the output vs the old second RPC, in one run.

    .venv/bin/python -m bench.rpc_ab --frames 400 --background 0 7 --json docs/bench/rpc-ab.json

Before #18 the server, after every reply, called into EngineCore once more
(`session_summary`: scan every request for the session's id, walk its block table, read its
retention counters). Now the same state arrives on the reply's own output (`SessionReport`).
This bench runs the production path (`EngineSession`, the server's scheduler) on one engine and
alternates, in blocks of `--block` frames, the new path ("report": the frame is done when its
reply's last output arrives) and the old one ("report+rpc": the same, then the old RPC, which
is reproduced here and installed only in this bench's engine). Alternating blocks in one run
cancel machine drift. `--background N` adds N other bounded sessions that stream frames all the
time (the RPC then also waits for the engine step in flight); each value is a phase.

Prints one JSON document (and writes it with `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from retention.vllm_adapter.chunk_grammar import ChunkGrammarScheduler
from retention.vllm_adapter.introspect import _blocks_held, _find_request

OLD_SUMMARY_METHOD = "vllm_realtime_bench_old_session_summary"


def _old_session_summary(core: Any, external_id: str) -> dict[str, Any] | None:
    """The pre-#18 `session_summary` utility, as it was (b59cae0)."""
    scheduler = core.scheduler
    found = _find_request(scheduler, external_id)
    if found is None:
        return None
    internal_id, request = found
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    held = sum(_blocks_held(m.req_to_blocks.get(internal_id, ())) for m in managers)
    retention = getattr(scheduler, "retention", None)
    counters = None
    if retention is not None and retention.is_retention_session(internal_id):
        counters = retention.summary(request)
    return {"kv_blocks_held": held, "retention": counters}


class OldPathScheduler(ChunkGrammarScheduler):
    """The server's scheduler, unchanged; naming it makes EngineCore import this module, which
    installs the old utility there (see `_install`)."""


def _install() -> None:
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, OLD_SUMMARY_METHOD):
        setattr(EngineCore, OLD_SUMMARY_METHOD, _old_session_summary)


_install()  # in EngineCore, when vLLM resolves scheduler_cls


class TextSession:
    def __init__(self, engine: Any, max_tokens: int) -> None:
        from protocol import SamplingConfig, SessionConfig
        from realtime.engine_session import EngineSession, chat_format_of

        self.chat = chat_format_of(engine)
        self.es = EngineSession(
            engine,
            f"ab-{uuid.uuid4().hex[:12]}",
            SamplingConfig(max_tokens=max_tokens, temperature=0.0),
            {"sink_chunks": 1, "window_chunks": 8},
            ignore_eos=True,
        )
        self.config = SessionConfig(
            modality="text", instructions="You watch a camera. Answer in one short sentence."
        )
        self.sent = 0

    async def frame(self, *, old_rpc: bool) -> float:
        """One frame; ms from handing it to vLLM to having the session's state."""
        from protocol import Frame
        from realtime.engine_session import ChunkFinished, render_chunk

        i = self.sent
        text = f"Frame {i}: the hallway is empty; the door on the left is closed."
        frame = Frame(i, None, "text", None, text.encode(), text, None, None)
        prompt = render_chunk(
            frame,
            self.config,
            first=i == 0,
            multimodal=False,
            after_reply=self.es.turn_open,
            chat=self.chat,
        )
        started = time.perf_counter()
        report = None
        async for item in self.es.run_chunk(prompt):
            if isinstance(item, ChunkFinished):
                report = item.report
        assert report is not None
        if old_rpc:
            summary = await self.es.engine.engine_core.call_utility_async(
                OLD_SUMMARY_METHOD, self.es.request_id
            )
            assert summary is not None and summary["kv_blocks_held"] == report.kv_blocks_held
        took = (time.perf_counter() - started) * 1e3
        self.sent += 1
        return took


def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100)
    return {
        "p50": round(q[49], 2),
        "p90": round(q[89], 2),
        "p99": round(q[98], 2),
        "mean": round(statistics.fmean(values), 2),
        "n": len(values),
    }


async def phase(engine: Any, args: argparse.Namespace, background: int) -> dict[str, Any]:
    measured = TextSession(engine, args.max_tokens)
    others = [TextSession(engine, args.max_tokens) for _ in range(background)]
    stop = asyncio.Event()

    async def stream(s: TextSession) -> None:
        while not stop.is_set():
            await s.frame(old_rpc=False)

    tasks = [asyncio.create_task(stream(s)) for s in others]
    rows: dict[str, list[float]] = {"report": [], "report+rpc": []}
    try:
        for _ in range(args.warmup):
            await measured.frame(old_rpc=False)
        for i in range(args.frames):
            old = (i // args.block) % 2 == 1
            rows["report+rpc" if old else "report"].append(await measured.frame(old_rpc=old))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in [measured, *others]:
            await s.es.abort()
    new, old = _summary(rows["report"]), _summary(rows["report+rpc"])
    return {
        "background_sessions": background,
        "report": new,
        "report+rpc": old,
        "saved_ms": {k: round(old[k] - new[k], 2) for k in ("p50", "p90", "p99", "mean")},
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from realtime.engine import EngineSettings, start_engine

    engine = start_engine(
        EngineSettings(
            model="smollm2-135m-instruct",
            max_model_len=2048,
            kv_cache_memory_bytes=args.kv_mib << 20,
            block_size=32,
            max_num_seqs=16,
            dtype="float32",
            # By module path: run as __main__, this module must still be found by EngineCore.
            extra={"scheduler_cls": "bench.rpc_ab.OldPathScheduler"},
        )
    )
    try:
        phases = [await phase(engine, args, n) for n in args.background]
    finally:
        engine.shutdown()
    return {
        "bench": "rpc_ab",
        "model": "smollm2-135m-instruct",
        "frames_per_phase": args.frames,
        "block": args.block,
        "max_tokens": args.max_tokens,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "phases": phases,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--frames", type=int, default=400)
    p.add_argument("--block", type=int, default=20, help="frames per arm before switching")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--kv-mib", type=int, default=384)
    p.add_argument("--background", type=int, nargs="+", default=[0, 7])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
