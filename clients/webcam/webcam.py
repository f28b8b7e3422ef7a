#!/usr/bin/env python3
"""Stream a camera, a video file, an RTSP/HTTP stream or ffmpeg's test pattern to vllm-realtime.

::

    python clients/webcam/webcam.py --source /dev/video0 --fps 2 --size 320x240 \\
        --prompt "What changed?" --url ws://127.0.0.1:8000/v1/realtime --api-key KEY
    python clients/webcam/webcam.py --source testsrc --max-frames 20      # no camera needed
    python clients/webcam/webcam.py --reply-every 0    # watch only; type questions, Enter asks

``--reply-every N`` answers every Nth frame and only watches the others (``frame.append`` with
``reply: false``: prefilled, nothing generated); 0 watches every frame. A line typed on stdin is a
question, sent between two frames (a ``text`` chunk), its answer streamed (``--no-questions``
turns stdin off).

ffmpeg decodes the source and writes MJPEG at ``--fps`` and ``--size`` to a pipe; the script
splits the pipe into JPEG images at their SOI/EOI markers (:class:`JpegSplitter`) and sends them
through the Python SDK (``clients/python``), printing each reply as it streams.

One frame is in flight at a time (the protocol's rule).  Frames that arrive meanwhile are not
queued: a one-frame slot keeps the newest, and each newer frame replaces (drops) the one there,
so the frame sent when a reply finishes is the latest one and memory stays bounded whatever the
source's rate.  Drops are counted and reported at exit, with latency percentiles.

``--source``: ``/dev/videoN`` (V4L2), a file (played at its own rate, looped with ``--loop``),
an ``rtsp://`` / ``http(s)://`` / other ffmpeg URL, or ``testsrc`` / ``lavfi:<graph>``.

Outages: the session is opened resumable (``--resume-grace``), so a network drop resumes the
same session (the SDK reconnects, at most ``--retries`` times); a server that drains or
restarts gets a new session, except a drain that hands the session over (``server.draining``
with ``handover``: replicas sharing a ``--session-store``, ``--url`` pointing at the router):
the SDK then resumes the same session on another replica, context intact.  That is the SDK's
own reconnect (this script opens its session through ``vllm_realtime_client.connect`` and adds
no logic of its own), tested in tests/scale_out/test_drain_handover_clients.py.  A reply lost
with a connection counts as a dropped frame.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from vllm_realtime_client import (
        ClientError,
        ConnectionLost,
        RealtimeError,
        RealtimeSession,
        ServerEvent,
        Unauthorized,
        connect,
    )
except ImportError:  # run from a checkout: use the SDK next door
    sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))
    from vllm_realtime_client import (
        ClientError,
        ConnectionLost,
        RealtimeError,
        RealtimeSession,
        ServerEvent,
        Unauthorized,
        connect,
    )

SOI = b"\xff\xd8"
_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM, RST0-7: markers without a length


class JpegSplitter:
    """Split a byte stream of back-to-back JPEGs (ffmpeg's MJPEG pipe) into single images.

    An image runs from SOI (``FF D8``) to EOI (``FF D9``).  The splitter walks the marker
    segments rather than searching for ``FF D9``: segments before the scan carry a length (so a
    thumbnail's EOI inside an APP1 segment is skipped), and in entropy-coded data every ``FF``
    byte is stuffed (``FF 00``) or a restart marker, so the first other marker ends the scan.
    Bytes before an SOI, and an image that breaks the syntax, are skipped (``skipped_bytes``).
    The buffer never holds more than ``max_bytes``; past that the partial image is dropped.
    """

    def __init__(self, max_bytes: int = 16 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self.skipped_bytes = 0
        self._buf = bytearray()
        self._in_image = False
        self._pos = 0
        self._entropy = False

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes from the stream; return the images completed by them, in order."""
        self._buf += data
        images: list[bytes] = []
        while (image := self._next()) is not None:
            images.append(image)
        if len(self._buf) > self.max_bytes:
            self.skipped_bytes += len(self._buf)
            self._buf.clear()
            self._in_image = False
        return images

    def _resync(self) -> None:
        """The image at the head is broken: skip its SOI and look for the next one."""
        self.skipped_bytes += 2
        del self._buf[:2]
        self._in_image = False

    def _next(self) -> bytes | None:
        buf = self._buf
        while True:
            if not self._in_image:
                start = buf.find(SOI)
                if start < 0:
                    keep = 1 if buf.endswith(b"\xff") else 0
                    self.skipped_bytes += len(buf) - keep
                    del buf[: len(buf) - keep]
                    return None
                self.skipped_bytes += start
                del buf[:start]
                self._in_image, self._pos, self._entropy = True, 2, False
            pos, n = self._pos, len(buf)
            while True:
                if self._entropy:
                    i = buf.find(b"\xff", pos)
                    if i < 0 or i + 1 >= n:
                        pos = n if i < 0 else i
                        break
                    following = buf[i + 1]
                    if following == 0x00 or following in _STANDALONE or following == 0xFF:
                        pos = i + (1 if following == 0xFF else 2)
                        continue
                    self._entropy, pos = False, i  # a marker ends the scan
                    continue
                if pos + 2 > n:
                    break
                if buf[pos] != 0xFF:
                    self._resync()
                    break
                marker = buf[pos + 1]
                if marker == 0xFF:  # fill byte
                    pos += 1
                    continue
                if marker == 0xD9:  # EOI
                    end = pos + 2
                    image = bytes(buf[:end])
                    del buf[:end]
                    self._in_image = False
                    return image
                if marker in _STANDALONE:
                    pos += 2
                    continue
                if marker == 0xD8:  # an SOI inside an image: the previous one was cut short
                    self._resync()
                    break
                if pos + 4 > n:
                    break
                length = (buf[pos + 2] << 8) | buf[pos + 3]
                if length < 2:
                    self._resync()
                    break
                if pos + 2 + length > n:
                    break
                pos += 2 + length
                if marker == 0xDA:  # SOS: entropy-coded data follows its header
                    self._entropy = True
            if not self._in_image:
                continue  # resynced: look for the next SOI
            self._pos = pos
            return None


@dataclass
class Frame:
    """One captured JPEG."""

    number: int
    data: bytes
    captured_at: float


class LatestFrame:
    """A one-frame slot between the capture loop and the sender: newest wins, older are dropped."""

    def __init__(self) -> None:
        self.captured = 0
        self.dropped = 0
        self._frame: Frame | None = None
        self._event = asyncio.Event()
        self._closed = False

    def put(self, data: bytes) -> None:
        if self._frame is not None:
            self.dropped += 1  # arrived while a frame was in flight, and a newer one came
        self._frame = Frame(self.captured, data, time.time())
        self.captured += 1
        self._event.set()

    def close(self) -> None:
        """No more frames (the source ended, or the user stopped): wake the sender."""
        self._closed = True
        self._event.set()

    async def take(self) -> Frame | None:
        """The newest frame not sent yet, waiting for one; None once closed."""
        while self._frame is None:
            if self._closed:
                return None
            self._event.clear()
            await self._event.wait()
        frame, self._frame = self._frame, None
        return frame

    def discard(self) -> None:
        """At exit: a frame still waiting was never sent; count it as dropped."""
        if self._frame is not None:
            self.dropped += 1
            self._frame = None


@dataclass
class Stats:
    """What the run did; printed at exit."""

    sent: int = 0
    replies: int = 0  # response.done of frames (watched ones included)
    watched: int = 0  # frames sent with reply: false
    answers: int = 0  # questions typed on stdin, answered
    sessions: int = 0
    resumes: int = 0
    lost: int = 0  # replies lost with a connection (the server restarted mid-reply)
    statuses: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)

    def summary(self, slot: LatestFrame, splitter: JpegSplitter) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)

        def pct(p: float) -> float | None:
            if not lat:
                return None
            return round(lat[min(len(lat) - 1, round(p / 100 * (len(lat) - 1)))], 1)

        return {
            "captured": slot.captured,
            "sent": self.sent,
            "replies": self.replies,
            "watched": self.watched,
            "answers": self.answers,
            "dropped": slot.dropped,
            "sessions": self.sessions,
            "resumes": self.resumes,
            "lost": self.lost,
            "statuses": self.statuses,
            "latency_ms": {
                "mean": round(statistics.fmean(lat), 1) if lat else None,
                "p50": pct(50),
                "p95": pct(95),
                "max": round(lat[-1], 1) if lat else None,
            },
            "skipped_bytes": splitter.skipped_bytes,
        }


def parse_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 8 or int(height) < 8:
        raise argparse.ArgumentTypeError(f"--size must look like 320x240, not {text!r}")
    return int(width), int(height)


def ffmpeg_command(
    source: str,
    *,
    fps: float,
    size: tuple[int, int],
    quality: int = 5,
    loop: bool = False,
    ffmpeg: str = "ffmpeg",
) -> list[str]:
    """The ffmpeg command line that turns ``source`` into an MJPEG stream on stdout."""
    width, height = size
    cmd = [ffmpeg, "-hide_banner", "-loglevel", "error", "-nostdin"]
    if source == "testsrc" or source.startswith("lavfi:"):
        graph = source.partition(":")[2] if source.startswith("lavfi:") else "testsrc"
        if "=" not in graph:
            graph += f"=size={width}x{height}:rate={fps:g}"
        cmd += ["-re", "-f", "lavfi", "-i", graph]  # -re: at the pattern's rate, not flat out
    elif source.startswith("/dev/video"):
        cmd += ["-f", "v4l2", "-i", source]
    elif "://" in source:
        if source.startswith("rtsp://"):
            cmd += ["-rtsp_transport", "tcp"]
        cmd += ["-i", source]
    else:
        cmd += ["-re", *(["-stream_loop", "-1"] if loop else []), "-i", source]
    cmd += [
        "-an",
        "-vf",
        f"fps={fps:g},scale={width}:{height}",
        "-c:v",
        "mjpeg",
        "-q:v",
        str(quality),
        "-f",
        "image2pipe",
        "pipe:1",
    ]
    return cmd


async def capture(stdout: asyncio.StreamReader, splitter: JpegSplitter, slot: LatestFrame) -> None:
    """Read ffmpeg's pipe to its end, keeping only the newest frame (it never blocks ffmpeg)."""
    try:
        while chunk := await stdout.read(1 << 16):
            for image in splitter.feed(chunk):
                slot.put(image)
    finally:
        slot.close()


class Questions:
    """Lines typed on stdin, read by a daemon thread (it never holds up the exit)."""

    def __init__(self) -> None:
        self.pending: deque[str] = deque()
        self.asked = 0

    def start(self, stream: Any = None) -> None:
        stream = sys.stdin if stream is None else stream

        def read() -> None:
            try:
                for line in stream:
                    if line.strip():
                        self.pending.append(line.strip())
            except Exception:  # stdin closed or not readable (e.g. under a test runner)
                return

        threading.Thread(target=read, name="webcam-questions", daemon=True).start()

    def take(self) -> str | None:
        return self.pending.popleft() if self.pending else None


def wants_reply(number: int, reply_every: int) -> bool:
    """Frame `number` (0, 1, … sent in this run) is answered: every `reply_every`th one, the
    last of each group (0: none, 1: all)."""
    return reply_every > 0 and number % reply_every == reply_every - 1


async def ask(
    session: RealtimeSession, question: str, stats: Stats, args: argparse.Namespace, out: Any
) -> None:
    stream = session.stream_ask(question, frame_id=f"ask-{stats.answers}", timeout=args.timeout)
    out.write(f"[ask] {question}\n  → ")
    out.flush()
    async for delta in stream:
        out.write(delta.delta)
        out.flush()
    done = stream.done
    assert done is not None
    stats.answers += 1
    out.write(f"  ({done.status})\n")
    out.flush()


async def send_frames(
    session: RealtimeSession,
    slot: LatestFrame,
    stats: Stats,
    args: argparse.Namespace,
    out: Any,
    questions: Questions | None = None,
) -> bool:
    """Send the newest frame whenever the previous reply is done; False when out of frames.
    A question typed meanwhile goes first (between two frames)."""
    while not args.max_frames or stats.replies < args.max_frames:
        question = questions.take() if questions is not None else None
        if question is not None:
            try:
                await ask(session, question, stats, args, out)
            except ConnectionLost:
                if session.is_closed:
                    raise
                out.write(" (lost with the connection)\n")
            continue
        frame = await slot.take()
        if frame is None:
            return False
        reply = wants_reply(stats.replies, args.reply_every)
        stream = session.stream_frame(
            frame.data,
            prompt=(args.prompt or None) if reply else None,
            frame_id=f"frame-{frame.number}",
            timestamp=frame.captured_at,
            reply=reply,
            timeout=args.timeout,
        )
        out.write(f"[frame-{frame.number}] ")
        out.flush()
        try:
            async for delta in stream:
                out.write(delta.delta)
                out.flush()
        except ConnectionLost:
            if session.is_closed:
                raise
            # Lost with a connection while the session went on (resumed, or a new one after
            # a restart): count it and send the next frame.
            out.write(" (lost with the connection)\n")
            stats.lost += 1
            continue
        finally:
            # Sent = accepted by the server (acked); a frame it never took counts as dropped.
            if stream.ack is not None:
                stats.sent += 1
            else:
                slot.dropped += 1
        done = stream.done
        assert done is not None
        stats.replies += 1
        if done.status == "ingested":
            stats.watched += 1
        stats.statuses[done.status] = stats.statuses.get(done.status, 0) + 1
        if done.timing.total_ms is not None:
            stats.latencies_ms.append(done.timing.total_ms)
        total = f"{done.timing.total_ms:.0f} ms" if done.timing.total_ms is not None else "? ms"
        held = (
            f"{done.retention.frames_retained} frames / {done.retention.kv_blocks_held} KV blocks"
            if done.retention is not None
            else "no retention info"
        )
        out.write(
            f"{'watched' if done.status == 'ingested' else ''}  ({total}, {done.status}, {held})\n"
        )
        out.flush()
    return True


async def run(
    args: argparse.Namespace,
    out: Any = sys.stdout,
    err: Any = sys.stderr,
    *,
    handle_signals: bool = True,
    questions: Questions | None = None,
) -> int:
    """Capture and stream until the source ends, --max-frames replies, or SIGINT/SIGTERM.

    Returns the exit status: 0 done, 1 failed, 2 no ffmpeg, 3 unauthorized.
    """
    ffmpeg = shutil.which(args.ffmpeg)
    if ffmpeg is None:
        err.write(f"webcam: {args.ffmpeg!r} not found; install ffmpeg\n")
        return 2
    cmd = ffmpeg_command(
        args.source,
        fps=args.fps,
        size=args.size,
        quality=args.quality,
        loop=args.loop,
        ffmpeg=ffmpeg,
    )
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    splitter, slot, stats = JpegSplitter(), LatestFrame(), Stats()
    reader = asyncio.create_task(capture(proc.stdout, splitter, slot))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM) if handle_signals else ():
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    retention: dict[str, Any] = (
        {"window_chunks": args.window} if args.window > 0 else {"enabled": False}
    )
    rc = 0
    failures = 0
    if questions is None and args.questions:
        questions = Questions()
        questions.start()

    def notice(event: ServerEvent) -> None:
        # Sessions the SDK moved to by itself count too (after a drain or a restart).
        if event.type == "session.opened":
            stats.sessions += 1
            if stats.sessions > 1:
                err.write(f"webcam: new session {event.session_id}\n")
        elif event.type == "session.resumed":
            stats.resumes += 1
            err.write(
                f"webcam: connection dropped; session resumed at frame {event.next_frame_index}\n"
            )
        elif event.type == "server.draining":
            where = "resuming on another replica" if event.handover else "moving to a new session"
            err.write(f"webcam: the server is shutting down; {where}\n")

    async def stream_sessions() -> None:
        nonlocal rc, failures
        while True:
            before = stats.replies
            try:
                async with connect(
                    args.url,
                    api_key=args.api_key,
                    timeout=args.timeout,
                    on_event=notice,
                    max_retries=args.retries,
                ) as session:
                    opened = await session.open(
                        instructions=args.instructions or None,
                        retention=retention,
                        sampling={"max_tokens": args.max_tokens},
                        resumable={"grace_s": args.resume_grace} if args.resume_grace else None,
                        # What this script sends: single images at --fps (admission reserves
                        # KV and engine time for exactly that).
                        limits={"max_clip_frames": 1, "frames_per_s": args.fps},
                    )
                    err.write(
                        f"webcam: session {opened.session_id} on {opened.limits.model} "
                        f"({args.size[0]}x{args.size[1]} at {args.fps:g} fps)\n"
                    )
                    more = await send_frames(session, slot, stats, args, out, questions)
                    if not more or (args.max_frames and stats.replies >= args.max_frames):
                        return
            except Unauthorized as exc:
                err.write(f"webcam: {exc}\n")
                rc = 3
                return
            except (RealtimeError, ClientError) as exc:
                out.write("\n")
                # Give up after --retries sessions in a row that ended without a single reply
                # (a server that stays down), waiting longer each time.
                failures = 1 if stats.replies > before else failures + 1
                if not args.reopen or failures > max(args.retries, 1):
                    err.write(f"webcam: {exc}\n")
                    rc = 1
                    return
                err.write(f"webcam: session ended ({exc}); opening a new one\n")
                await asyncio.sleep(min(0.5 * 2 ** (failures - 1), 8.0))

    sender = asyncio.create_task(stream_sessions())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({sender, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sender, stopper):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender  # async with closes the session (session.close → session.closed)
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        slot.discard()
        for sig in handled:
            loop.remove_signal_handler(sig)
    if stats.sent == 0 and rc == 0 and not stop.is_set():
        err.write(f"webcam: no frames from {args.source!r} (ffmpeg exited {proc.returncode})\n")
        rc = 1
    summary = stats.summary(slot, splitter)
    lat = summary["latency_ms"]
    err.write(
        f"webcam: captured {summary['captured']}, sent {summary['sent']}, replies "
        f"{summary['replies']}, dropped {summary['dropped']} (arrived while a frame was in "
        f"flight); latency p50 {lat['p50']} ms, p95 {lat['p95']} ms\n"
    )
    if args.json:
        out.write(json.dumps(summary) + "\n")
    return rc


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="webcam.py",
        description="Stream a camera (or file, URL, test pattern) to a vllm-realtime server.",
    )
    p.add_argument(
        "--source",
        default="/dev/video0",
        help="/dev/videoN, a file, an rtsp:// or http(s):// URL, 'testsrc' or 'lavfi:<graph>'",
    )
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime", help="WebSocket endpoint")
    p.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    p.add_argument("--fps", type=float, default=2.0, help="frames per second taken from the source")
    p.add_argument("--size", type=parse_size, default=(320, 240), help="frame size, WxH")
    p.add_argument("--prompt", default="What changed?", help="prompt sent with every frame")
    p.add_argument(
        "--instructions",
        default="You watch a camera. In one short sentence, say what you see.",
        help="the session's instructions (system prompt)",
    )
    p.add_argument(
        "--window", type=int, default=8, help="retention.window_chunks (0: retention off)"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens per reply")
    p.add_argument(
        "--reply-every",
        type=int,
        default=1,
        help="answer every Nth frame, only watch the others (reply: false); 0: watch only",
    )
    p.add_argument(
        "--no-questions",
        dest="questions",
        action="store_false",
        help="do not read questions from stdin (default: each line typed is asked)",
    )
    p.add_argument(
        "--max-frames", type=int, default=0, help="stop after this many replies (0: no limit)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per reply")
    p.add_argument("--quality", type=int, default=5, help="JPEG quality, ffmpeg -q:v (2-31)")
    p.add_argument("--loop", action="store_true", help="loop a file source")
    p.add_argument(
        "--no-reopen",
        dest="reopen",
        action="store_false",
        help="exit when the server ends the session (default: open a new one)",
    )
    p.add_argument(
        "--resume-grace",
        type=float,
        default=30.0,
        help="seconds the server keeps the session after a drop, for a resume (0: off)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=8,
        help="connection attempts per outage before giving up (backoff 0.5 s doubling to 8 s)",
    )
    p.add_argument("--ffmpeg", default="ffmpeg", help="the ffmpeg executable")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    args = p.parse_args(argv)
    if args.fps <= 0 or args.fps > 120:
        p.error("--fps must be in (0, 120]")
    if args.window < 0 or args.max_tokens < 1 or args.max_frames < 0 or args.reply_every < 0:
        p.error("--window, --max-tokens, --max-frames and --reply-every must not be negative")
    if args.resume_grace < 0 or args.retries < 0:
        p.error("--resume-grace and --retries must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
