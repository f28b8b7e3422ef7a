"""Start one engine in a fresh process and report which of our hooks its processes carry.

Run by tests/retention/test_plugin_scope.py; prints one ``PROBE {json}`` line.

- ``python -m tests.retention.engine_probe plain MODEL_DIR``: a plain `vllm.LLM`, as anyone
  would start it, with no vllm-realtime settings. This mode imports nothing of ours, so any
  module of ours in a process is the entry point's doing.
- ``python -m tests.retention.engine_probe serve SERVE_ARGS...``: the engine
  `vllm-realtime serve SERVE_ARGS` starts (its settings captured where `serve` would start the
  server), behind a real server on loopback; one session sends one text frame through it.

A fresh process, because vLLM loads its plugins once per process: a plain engine started inside
the test session would meet a front end that already runs ours; and because the worker's report
is read by sending it a function (`collective_rpc`; vLLM ships it with cloudpickle), which needs
VLLM_ALLOW_INSECURE_SERIALIZATION in the front end and the engine alike, something no shared
test engine should carry. EngineCore's utilities are read through vLLM's own utility call: what
a client sees.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

CORE_UTILITIES = (
    "vllm_realtime_kv_stats",
    "vllm_realtime_retention_state",
    "vllm_realtime_scheduler_state",
    "vllm_realtime_heap_stats",
)
WORKER_UTILITIES = ("vllm_realtime_worker_stats", "vllm_realtime_heap_stats")


def process_report(worker: Any = None) -> dict[str, Any]:
    """What this process holds of ours: our modules, and our marks on vLLM's classes. Runs in
    the probe's front end and, through collective_rpc, in the engine's worker."""
    marked: list[str] = []
    for module, cls in (
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
        ("vllm.v1.worker.worker_base", "WorkerBase"),
        ("vllm.v1.engine.core", "EngineCore"),
        ("vllm.v1.engine.async_llm", "AsyncLLM"),
    ):
        loaded = sys.modules.get(module)
        if loaded is not None:
            owner = getattr(loaded, cls)
            marked += [f"{cls}.{name}" for name in dir(owner) if "realtime" in name]
            if cls == "AsyncLLM" and getattr(owner.shutdown, "_vllm_realtime_once", False):
                marked.append("AsyncLLM.shutdown")
    return {
        "pid": os.getpid(),
        "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("retention", "realtime")),
        "marked": sorted(marked),
    }


def _utility_args(name: str) -> tuple[Any, ...]:
    return {
        "vllm_realtime_retention_state": ("no-such-session",),
        "vllm_realtime_heap_stats": ("trim_read",),
    }.get(name, ())


def probe_plain(model: str) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(
        model=model,
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        block_size=32,
        dtype="float32",
        enforce_eager=True,
        max_num_seqs=2,
    )
    client = llm.llm_engine.engine_core
    try:
        core = {}
        for name in CORE_UTILITIES:
            try:
                client.call_utility(name, *_utility_args(name))
                core[name] = True
            except Exception:  # vLLM's answer to a method EngineCore lacks
                core[name] = False
        (worker,) = llm.collective_rpc(process_report)
        return {"front": process_report(), "core_utilities": core, "worker": worker}
    finally:
        client.shutdown()


def serve_settings(argv: list[str]) -> Any:
    """The EngineSettings `vllm-realtime serve` builds from `argv`, captured where it would
    start the server."""
    from realtime import cli, server

    captured: list[Any] = []

    def capture(config: Any, settings: Any) -> int:
        captured.append(settings)
        return 0

    server.run_server = capture  # type: ignore[assignment]
    assert cli.main(["serve", *argv]) == 0
    (settings,) = captured
    return settings


async def _one_text_frame(url: str) -> dict[str, Any]:
    import websockets

    from tests.realtime.conftest import SUBPROTOCOLS, open_session, recv_until

    async with websockets.connect(url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws, modality="text", sampling={"max_tokens": 2})
        await ws.send(json.dumps({"type": "frame.append", "text": "Hello there."}))
        done, _ = await recv_until(ws, "response.done", timeout=300)
        return done


async def probe_serve(argv: list[str]) -> dict[str, Any]:
    from realtime.engine import start_engine
    from tests.realtime.conftest import _serve

    settings = serve_settings(argv)
    engine: Any = start_engine(settings)
    try:
        async for running in _serve(engine, None, model_name=settings.model, max_sessions=2):
            done = await _one_text_frame(running.url)
        core = {}
        for name in CORE_UTILITIES:
            try:
                await engine.engine_core.call_utility_async(name, *_utility_args(name))
                core[name] = True
            except Exception:
                core[name] = False
        workers = {}
        for name in WORKER_UTILITIES:
            try:
                await engine.collective_rpc(name, args=_utility_args(name))
                workers[name] = True
            except Exception:
                workers[name] = False
        (worker,) = await engine.collective_rpc(process_report)
        return {
            "introspection": settings.introspection,
            "response_done": done,
            "front": process_report(),
            "core_utilities": core,
            "worker_utilities": workers,
            "worker": worker,
        }
    finally:
        engine.shutdown()


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    report = probe_plain(rest[0]) if mode == "plain" else asyncio.run(probe_serve(rest))
    print("PROBE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
