"""`vllm-realtime` command line: `serve`, `models list|build` and `selfcheck`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from retention.policy import CONSOLIDATION_MODES


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _reprefill_piece(raw: str) -> int:
    value = int(raw)
    if value < 0 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be 0 or a power of two, got {value}")
    return value


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {raw}")
    return value


def parse_engine_passthrough(tokens: list[str]) -> dict[str, Any]:
    """`--some-engine-arg VALUE` / `--flag` pairs (vLLM engine args) → AsyncEngineArgs kwargs."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise SystemExit(f"unexpected argument {tok!r}")
        key, eq, val = tok[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            out[key] = _parse_value(val)
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[key] = _parse_value(tokens[i + 1])
            i += 1
        else:
            out[key] = True
        i += 1
    return out


def _cmd_models(args: argparse.Namespace) -> int:
    from realtime.models import (
        DEFAULT_MODELS,
        DEFAULT_SERVE_MODEL,
        build_model,
        is_built,
        model_dir,
    )

    if args.action == "list":
        for name, spec in DEFAULT_MODELS.items():
            state = "built" if is_built(name) else "not built"
            default = " (default)" if name == DEFAULT_SERVE_MODEL else ""
            print(f"{name}{default}\t{spec.modality}\t{state}\t{model_dir(name)}")
            print(f"    {spec.description}")
        return 0
    names = list(DEFAULT_MODELS) if args.all or not args.names else args.names
    for name in names:
        if name not in DEFAULT_MODELS:
            print(
                f"unknown default model {name!r}; known: {', '.join(DEFAULT_MODELS)}",
                file=sys.stderr,
            )
            return 2
        print(build_model(name, force=args.force))
    return 0


def _cmd_serve(args: argparse.Namespace, passthrough: list[str]) -> int:
    from realtime.config import ServerConfig
    from realtime.engine import EngineSettings
    from realtime.server import run_server

    settings = EngineSettings(
        model=args.model,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        max_sessions=args.max_sessions,
        consolidation=args.consolidation,
        reprefill_piece=args.reprefill_piece,
        extra=parse_engine_passthrough(passthrough),
    )
    keys = list(args.api_key or [])
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=keys[0] if keys else None,
        api_keys=tuple(keys[1:]),
        max_sessions=args.max_sessions,
        max_sessions_per_key=args.max_sessions_per_key,
        idle_timeout_s=args.idle_timeout,
        max_frame_bytes=args.max_frame_bytes,
        max_frames_per_s=args.max_frames_per_s,
        frame_burst=args.frame_burst,
        retention_max_position=args.retention_max_position,
        consolidation=args.consolidation,
        max_chunk_tokens=args.max_chunk_tokens,
        max_instructions_tokens=args.max_instructions_tokens,
        strict_budgets=args.strict_budgets,
        drain_timeout_s=args.drain_timeout,
        max_resume_grace_s=args.max_resume_grace,
        compute_headroom=args.compute_headroom or None,
        chunk_cost_ms=args.chunk_cost_ms,
        session_store=args.session_store,
        max_frame_pixels=args.max_frame_pixels or None,
        chat_template=args.chat_template,
        keep_alive_on_engine_death=args.keep_alive_on_engine_death,
    )
    settings = settings.with_overrides(max_frame_pixels=config.max_frame_pixels)
    return run_server(config, settings)


def _add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """The model and the engine: what vLLM is started with."""
    from realtime.engine import CPU_DEFAULT_MAX_MODEL_LEN, CPU_KV_SHARE
    from realtime.models import DEFAULT_SERVE_MODEL

    serve.add_argument(
        "--model", default=DEFAULT_SERVE_MODEL, help="default model name, local path or hub id"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this key (Bearer header or WS subprotocol); repeat to accept several",
    )
    serve.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="cap on the context, tokens (default: the model's own on a GPU, "
        f"{CPU_DEFAULT_MAX_MODEL_LEN} on CPU)",
    )
    serve.add_argument(
        "--kv-cache-memory-bytes",
        type=_positive_int,
        default=None,
        help="KV pool size, bytes (default: on a GPU, vLLM's --gpu-memory-utilization share of "
        "its memory; on CPU, what --max-sessions whole-context sessions reserve, plus 10%%, at "
        f"most {CPU_KV_SHARE * 100:.0f}%% of the memory available to the worker's NUMA node)",
    )
    serve.add_argument("--max-num-seqs", type=int, default=32)


def _add_session_flags(serve: argparse.ArgumentParser) -> None:
    """How many sessions, how big their input, how fast they may send."""
    serve.add_argument("--max-sessions", type=int, default=32)
    serve.add_argument("--idle-timeout", type=float, default=300.0, help="seconds without a frame")
    serve.add_argument("--max-frame-bytes", type=int, default=4 << 20)
    serve.add_argument(
        "--max-sessions-per-key", type=int, default=None, help="sessions one API key may hold"
    )
    serve.add_argument(
        "--max-frames-per-s",
        type=float,
        default=100.0,
        help="per-connection frame.append rate (0: no limit); over it: rate_limited",
    )
    serve.add_argument("--frame-burst", type=int, default=200, help="frames allowed at once")


def _add_retention_flags(serve: argparse.ArgumentParser) -> None:
    """Bounded sessions: consolidation, and the sizes admission reserves from."""
    serve.add_argument(
        "--retention-max-position",
        type=_positive_int,
        default=None,
        help="consolidate bounded sessions before this RoPE position (default: trained range)",
    )
    serve.add_argument(
        "--consolidation",
        choices=CONSOLIDATION_MODES,
        default=None,
        help="how bounded sessions reset positions: rotate the window's cached keys in place "
        "(no model step; 1D-RoPE models on CPU) or reprefill it (default: rotate where the "
        "engine can, else reprefill)",
    )
    serve.add_argument(
        "--reprefill-piece",
        type=_reprefill_piece,
        default=128,
        help="tokens per engine step of a consolidation's re-prefill, 0 or a power of two "
        "(0: the whole window in one step, which makes a new step size for the CPU worker to "
        "keep state for at nearly every consolidation)",
    )
    serve.add_argument(
        "--max-chunk-tokens",
        type=_positive_int,
        default=128,
        help="most tokens of one chunk's text (admission reserves bounded sessions from it)",
    )
    serve.add_argument(
        "--max-instructions-tokens",
        type=_positive_int,
        default=512,
        help="most tokens of session.open.instructions",
    )
    serve.add_argument(
        "--strict-budgets",
        action="store_true",
        help="refuse a client's retention budget whose worst case does not fit the model",
    )


def _add_operation_flags(serve: argparse.ArgumentParser) -> None:
    """Drain, resume, admission by compute, the shared session store."""
    from realtime.compute import DEFAULT_HEADROOM

    serve.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=20.0,
        help="on SIGTERM/SIGINT, seconds replies in flight get before they are cancelled",
    )
    serve.add_argument(
        "--max-resume-grace",
        type=_non_negative_float,
        default=60.0,
        help="cap on session.open.resumable.grace_s, seconds (0: no session is resumable)",
    )
    serve.add_argument(
        "--compute-headroom",
        type=_non_negative_float,
        default=DEFAULT_HEADROOM,
        help="share of a session's period its frame may take (alone, plus what the other "
        "sessions add by their declared pace and measured cost; 0: admit by KV and session "
        "counts only)",
    )
    serve.add_argument(
        "--chunk-cost-ms",
        type=_non_negative_float,
        default=None,
        help="the cost of a chunk's prefill, ms, instead of measuring it (replies then free)",
    )
    serve.add_argument(
        "--session-store",
        default=None,
        metavar="redis://HOST:PORT/DB",
        help="keep resumable sessions in this Redis, so any replica can resume them "
        "(docs/scale-out.md); default: in this process only",
    )
    # Engine death (issue #50): exit by default, so a restart policy brings the replica back.
    serve.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        default=keep_alive_from_env(os.environ),
        help="stay up after the engine died (503 on /health, engine_error to new sessions) "
        "instead of exiting with status 3; default from VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
    )


def keep_alive_from_env(env: Mapping[str, str]) -> bool:
    """`VLLM_KEEP_ALIVE_ON_ENGINE_DEATH` read as vLLM reads it (an integer, 0 by default), so
    one setting means the same to both; an unreadable value is refused, as vLLM refuses it."""
    raw = env.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0").strip() or "0"
    try:
        return bool(int(raw))
    except ValueError:
        raise SystemExit(
            f"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH must be an integer (0 or 1), got {raw!r}"
        ) from None


def _add_checkpoint_flags(serve: argparse.ArgumentParser) -> None:
    """A published checkpoint as its users run it: its frames' size, its chat template."""
    from realtime.media import DEFAULT_MAX_FRAME_PIXELS

    serve.add_argument(
        "--max-frame-pixels",
        type=int,
        default=DEFAULT_MAX_FRAME_PIXELS,
        help="most pixels (width x height) of one image or clip frame: a larger one is resized "
        "down to it, and the processor is told the same cap, so admission reserves a frame's "
        "tokens from it (0: the processor's own max pixels, 12-16 megapixels in published "
        "Qwen-VL configs)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="the chat template to write prompts with, a file or the template itself (vLLM's "
        "flag), instead of the model's own",
    )


def _add_machine_flags(serve: argparse.ArgumentParser) -> None:
    """What the machine decides unless told: the dtype (the KV pool is --kv-cache-memory-bytes)."""
    serve.add_argument(
        "--dtype",
        default="auto",
        help="the model's dtype (default auto: on CPU, bfloat16 where the CPU has native bf16 "
        "(avx512_bf16 or amx_bf16), else float32; on a GPU, vLLM's choice)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-realtime", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the realtime server (unknown --flags go to vLLM)")
    for add_flags in (
        _add_engine_flags,
        _add_session_flags,
        _add_retention_flags,
        _add_operation_flags,
        _add_checkpoint_flags,
        _add_machine_flags,
    ):
        add_flags(serve)
    models = sub.add_parser("models", help="list or build the embedded default models")
    models.add_argument("action", choices=["list", "build"])
    models.add_argument("names", nargs="*")
    models.add_argument("--all", action="store_true")
    models.add_argument("--force", action="store_true")
    check = sub.add_parser(
        "selfcheck",
        help="check bounded sessions on this machine's vLLM against their oracle (tiny local "
        "model: eviction, consolidation, preemption, blocks returned); exit 0 if all pass",
    )
    check.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the engine's dtype (the oracle is float32; half types get a looser tolerance)",
    )
    check.add_argument("--json", action="store_true", help="also print the results as JSON")
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        return _cmd_serve(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "selfcheck":
        from realtime.selfcheck import selfcheck

        return selfcheck(dtype=args.dtype, as_json=args.json)
    return _cmd_models(args)


if __name__ == "__main__":
    sys.exit(main())
