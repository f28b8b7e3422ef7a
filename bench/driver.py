"""Drive sessions on an AsyncLLM through the server's own `EngineSession`, and measure them.

A session is ONE streaming-input vLLM request fed one chunk at a time (the next chunk goes only
after the previous chunk's boundary), each chunk rendered by the server's own `render_chunk`,
and its state read from the `SessionReport` on the reply (no call into EngineCore per frame).
A stateless request is a plain, non-streaming vLLM request. Latencies are measured from
handing the chunk to vLLM to its last token (no WebSocket or JSON in between).

The frames every benchmark sends are here too (`text_frame`, `image_frame`, `frame_jpeg`):
deterministic, so every mode and every run sees the same input.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

from realtime.engine_session import ChunkDelta, ChunkFinished, EngineSession, render_chunk
from realtime.prompt_format import ChatFormat
from retention.records import SessionReport
from retention.vllm_adapter.introspect import kv_stats
from vllm_realtime_protocol import RealtimeError, SamplingConfig, SessionConfig
from vllm_realtime_protocol.state import Frame

# The server's default retention (protocol: sink_chunks=1, window_chunks=8), as the hub sends it.
DEFAULT_RETENTION: dict[str, Any] = {"sink_tokens": 0, "sink_chunks": 1, "window_chunks": 8}


class SessionEnded(Exception):
    """The engine ended the session (finished=True): context length, refusal, abort."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.stop_reason = message


@dataclass
class ChunkResult:
    latency_ms: float
    ttft_ms: float | None
    completion_tokens: int
    cumulative_prompt_tokens: int
    cached_tokens: int | None = None
    text: str = ""
    report: SessionReport | None = None  # EngineCore's, on a session's chunk boundary


@dataclass
class FrameRecord:
    """One frame of one session, as measured."""

    index: int
    latency_ms: float
    ttft_ms: float | None
    completion_tokens: int
    context_tokens: int  # tokens the session holds after the frame (prompt of a stateless one)
    kv_blocks: int | None  # KV blocks the session holds after the frame (stateless: during it)
    evictions: int = 0  # cumulative, from the retention state
    consolidations: int = 0
    cached_tokens: int | None = None  # stateless: prompt tokens served by the prefix cache
    t: float = 0.0  # seconds since the run started, at the end of the frame

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sampling_params(
    max_tokens: int, retention: dict[str, Any] | None, *, ignore_eos: bool = True
) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )
    if retention is not None:
        params.extra_args = {"streaming_retention": dict(retention)}
    return params


class StreamingSession:
    """One session on the server's own path (`EngineSession`): what the bench measures is what
    the server runs, chunk boundary and session report included."""

    def __init__(
        self, engine: Any, request_id: str, max_tokens: int, retention: dict[str, Any] | None
    ) -> None:
        self.request_id = request_id
        self.session = EngineSession(
            engine,
            request_id,
            SamplingConfig(max_tokens=max_tokens, temperature=0.0),
            None if retention is None else dict(retention),
            ignore_eos=True,
        )

    @property
    def chunks(self) -> int:
        return self.session.chunks

    async def send(self, prompt: dict[str, Any]) -> ChunkResult:
        text: list[str] = []
        finished: ChunkFinished | None = None
        try:
            async for item in self.session.run_chunk(prompt):
                if isinstance(item, ChunkDelta):
                    text.append(item.text)
                else:
                    finished = item
        except RealtimeError as exc:
            report = self.session.last_report
            code = report.error if report is not None and report.error else exc.code
            message = report.message if report is not None and report.message else exc.message
            raise SessionEnded(code, message or "") from None
        assert finished is not None
        return ChunkResult(
            latency_ms=finished.total_ms,
            ttft_ms=finished.ttft_ms,
            completion_tokens=finished.completion_tokens,
            cumulative_prompt_tokens=self.session.prompt_tokens_total,
            text="".join(text),
            report=finished.report,
        )

    async def close(self) -> None:
        await self.session.abort()


async def stateless_request(
    engine: Any, prompt: dict[str, Any], params: Any, request_id: str
) -> tuple[ChunkResult, int]:
    """A plain request; returns its result and its prompt length in tokens."""
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    prompt_len = 0
    cached: int | None = None
    text: list[str] = []
    async for out in engine.generate(prompt, params, request_id=request_id):
        completion = out.outputs[0] if out.outputs else None
        if completion is not None and completion.token_ids:
            if first is None:
                first = time.perf_counter()
            tokens += len(completion.token_ids)
            text.append(completion.text or "")
        prompt_len = len(out.prompt_token_ids or []) or prompt_len
        if out.num_cached_tokens is not None:
            cached = int(out.num_cached_tokens)
    now = time.perf_counter()
    return (
        ChunkResult(
            latency_ms=(now - start) * 1e3,
            ttft_ms=None if first is None else (first - start) * 1e3,
            completion_tokens=tokens,
            cumulative_prompt_tokens=prompt_len,
            cached_tokens=cached,
            text="".join(text),
        ),
        prompt_len,
    )


def stateless_prompt(
    config: SessionConfig,
    window: list[tuple[Frame, str]],
    frame: Frame,
    multimodal: bool,
    chat: ChatFormat,
) -> dict[str, Any]:
    """The prompt of a stateless sliding-window client: the instructions, the last W frames
    with the replies they got, then the new frame, in the same format as `render_chunk`."""
    parts: list[str] = []
    parts.append(chat.opening(config.instructions))
    images: list[Any] = []
    for past, reply in [*window, (frame, None)]:
        rendered = render_chunk(past, SessionConfig(modality=config.modality), chat=chat,
                                first=False, after_reply=False,
                                multimodal=multimodal)  # fmt: skip
        parts.append(rendered["prompt"])
        mm = rendered.get("multi_modal_data") or {}
        if "image" in mm:
            images.append(mm["image"])
        if reply is not None:
            parts.append(f"{reply}{chat.assistant_close}")
    prompt: dict[str, Any] = {"prompt": "".join(parts)}
    if images:
        prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    return prompt


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(max(tokens, 0) / block_size)


# --------------------------------------------------------------------------- sampling helpers


def engine_processes() -> list[Any]:
    import psutil

    return list(psutil.Process().children(recursive=True))


def engine_rss() -> dict[str, int]:
    """Resident memory of the engine's processes (EngineCore, worker), by process title."""
    out: dict[str, int] = {}
    for proc in engine_processes():
        with contextlib.suppress(Exception):
            name = proc.name()
            if proc.status() == "zombie":
                continue
            key = name if name.startswith("VLLM") else f"{name}:{proc.pid}"
            out[key] = out.get(key, 0) + int(proc.memory_info().rss)
    return out


@dataclass
class KvPoller:
    """Samples the KV blocks held by all requests while a concurrent run goes on."""

    engine: Any
    interval_s: float = 0.25
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, blocks, requests)
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        start = time.perf_counter()
        while True:
            with contextlib.suppress(Exception):
                stats = await kv_stats(self.engine)
                held = sum(int(v) for v in stats["blocks_by_request"].values())
                self.samples.append((time.perf_counter() - start, held, int(stats["num_requests"])))
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def session_blocks(engine: Any, request_id: str) -> int:
    stats = await kv_stats(engine)
    return int(stats["blocks_by_request"].get(request_id, 0))


FrameSource = Callable[[int], Frame]


# ------------------------------------------------------------------ frames

INSTRUCTIONS = (
    "You watch a camera feed, one frame at a time. After each frame, say in a few words what "
    "changed."
)

_COLORS = ("red", "blue", "green", "white", "black", "yellow", "grey")
_THINGS = ("car", "bicycle", "dog", "delivery van", "person with an umbrella", "bus", "cat")
_ACTIONS = ("moves left", "moves right", "stops", "turns around", "waits", "speeds up")
_PLACES = ("gate", "crossing", "bakery", "parked truck", "fountain", "bus stop", "old mill")


def frame_text(i: int, stream: int = 0) -> str:
    """Text turn `i` of camera `stream` (~25 SmolLM2 tokens)."""
    return (
        f"Camera {stream}, frame {i}: a {_COLORS[i % 7]} {_THINGS[(i // 7) % 7]} "
        f"{_ACTIONS[(i + stream) % 6]} near the {_PLACES[(i // 3 + stream) % 7]}."
    )


def text_frame(i: int, stream: int = 0) -> Frame:
    text = frame_text(i, stream)
    return Frame(
        frame_index=i,
        frame_id=f"s{stream}-f{i}",
        kind="text",
        media_format=None,
        data=text.encode(),
        text=text,
        prompt=None,
        timestamp=None,
    )


@lru_cache(maxsize=64)
def frame_jpeg(i: int, stream: int = 0, size: int = 224) -> bytes:
    """A synthetic camera frame: a square that moves across a gradient background."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (40 + (stream * 37) % 160, 90, 140))
    draw = ImageDraw.Draw(img)
    for y in range(0, size, 8):
        draw.rectangle((0, y, size, y + 7), fill=(40 + y % 200, 80 + (y * 3) % 150, 120))
    side = size // 5
    x = (i * 9) % (size - side)
    y = (i * 5 + stream * 11) % (size - side)
    draw.rectangle((x, y, x + side, y + side), fill=(240, 200 - (i * 7) % 150, 30))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def image_frame(i: int, stream: int = 0, size: int = 224) -> Frame:
    return Frame(
        frame_index=i,
        frame_id=f"s{stream}-f{i}",
        kind="image",
        media_format="jpeg",
        data=frame_jpeg(i, stream, size),
        text=None,
        prompt=None,
        timestamp=float(i),
    )
