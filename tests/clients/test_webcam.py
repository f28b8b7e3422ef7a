"""clients/webcam/webcam.py: the JPEG splitter, the drop-don't-queue slot, ffmpeg end to end."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import sys
from typing import Any

import pytest
from PIL import Image

from tests.clients.conftest import CLIENT_KEY, ROOT, WEBCAM, need_tool, webcam
from tests.clients.fake_server import fake_server
from tests.realtime.conftest import RunningServer


def jpeg(seed: int, size: tuple[int, int] = (48, 32), **save: Any) -> bytes:
    rng = random.Random(seed)
    img = Image.new("RGB", size)
    img.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(size[0] * size[1])])
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=70, **save)
    return buf.getvalue()


def with_thumbnail(image: bytes) -> bytes:
    """`image` with an APP1 segment holding a whole JPEG (its own FF D9 included) after SOI."""
    payload = b"Exif\x00\x00" + jpeg(99, (8, 8))
    app1 = b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload
    return image[:2] + app1 + image[2:]


def split(stream: bytes, chunk: int, splitter: Any = None) -> list[bytes]:
    splitter = splitter or webcam.JpegSplitter()
    out: list[bytes] = []
    for i in range(0, len(stream), chunk):
        out += splitter.feed(stream[i : i + chunk])
    return out


@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 20])
def test_splitter_returns_each_image_whole_whatever_the_chunking(chunk: int) -> None:
    images = [
        jpeg(1),
        with_thumbnail(jpeg(2)),  # an EOI inside APP1 must not end the image
        jpeg(3, progressive=True),  # several scans
        jpeg(4, (64, 64)),
    ]
    garbage = b"\x00\xff\x12junk\xff"
    splitter = webcam.JpegSplitter()
    got = split(garbage + images[0] + images[1] + garbage + images[2] + images[3], chunk, splitter)
    assert got == images
    assert splitter.skipped_bytes == 2 * len(garbage)
    for image in got:
        Image.open(io.BytesIO(image)).load()


def test_splitter_skips_a_truncated_image_and_bounds_its_buffer() -> None:
    whole = jpeg(5)
    cut = jpeg(6)[:300]  # the stream broke mid-scan
    assert split(cut + whole, 64) == [whole]
    splitter = webcam.JpegSplitter(max_bytes=1000)
    assert (
        splitter.feed(
            b"\xff\xd8\xff\xe0\x00\x10" + b"\x00" * 14 + b"\xff\xda\x00\x02" + b"1" * 2000
        )
        == []
    )
    assert len(splitter._buf) == 0 and splitter.skipped_bytes > 2000
    assert splitter.feed(whole) == [whole]


def test_latest_frame_slot_drops_instead_of_queueing() -> None:
    async def scenario() -> None:
        slot = webcam.LatestFrame()
        for n in range(5):
            slot.put(b"frame%d" % n)
        frame = await slot.take()
        assert frame is not None and (frame.number, frame.data) == (4, b"frame4")
        assert (slot.captured, slot.dropped) == (5, 4)
        waiter = asyncio.create_task(slot.take())
        await asyncio.sleep(0)
        slot.put(b"late")
        got = await waiter
        assert got is not None and got.data == b"late"
        slot.put(b"unsent")
        slot.discard()
        slot.close()
        assert await slot.take() is None
        assert (slot.captured, slot.dropped) == (7, 5)

    asyncio.run(scenario())


def test_ffmpeg_command_lines() -> None:
    cmd = webcam.ffmpeg_command("testsrc", fps=2, size=(160, 120))
    assert cmd[cmd.index("-f") : cmd.index("-f") + 4] == [
        "-f",
        "lavfi",
        "-i",
        "testsrc=size=160x120:rate=2",
    ]
    assert "-re" in cmd and cmd[-3:] == ["-f", "image2pipe", "pipe:1"]
    assert "fps=2,scale=160:120" in cmd
    v4l2 = webcam.ffmpeg_command("/dev/video2", fps=5, size=(320, 240))
    assert v4l2[v4l2.index("-f") : v4l2.index("-f") + 4] == ["-f", "v4l2", "-i", "/dev/video2"]
    rtsp = webcam.ffmpeg_command("rtsp://cam.local/stream", fps=1, size=(320, 240))
    assert rtsp[5:9] == ["-rtsp_transport", "tcp", "-i", "rtsp://cam.local/stream"]
    looped = webcam.ffmpeg_command("clip.mp4", fps=1, size=(320, 240), loop=True)
    assert looped[5:10] == ["-re", "-stream_loop", "-1", "-i", "clip.mp4"]
    graph = webcam.ffmpeg_command("lavfi:mandelbrot=size=64x64", fps=1, size=(64, 64))
    assert "mandelbrot=size=64x64" in graph


def test_arguments() -> None:
    args = webcam.parse_args(["--size", "224x168", "--fps", "0.5", "--window", "0"])
    assert args.size == (224, 168) and args.fps == 0.5 and args.window == 0 and args.reopen
    for bad in (["--size", "big"], ["--fps", "0"], ["--max-frames", "-1"]):
        with pytest.raises(SystemExit):
            webcam.parse_args(bad)


async def test_pipeline_drops_frames_while_a_slow_reply_is_in_flight() -> None:
    need_tool("ffmpeg", "apt-get install ffmpeg")
    async with fake_server(max_frame_bytes=1 << 20) as srv:
        args = webcam.parse_args(
            [
                "--source", "testsrc", "--fps", "20", "--size", "64x48", "--prompt", "slow",
                "--max-frames", "2", "--url", srv.url, "--json",
            ]
        )  # fmt: skip
        out, err = io.StringIO(), io.StringIO()
        rc = await webcam.run(args, out, err, handle_signals=False)
        assert rc == 0, err.getvalue()
        lines = out.getvalue().splitlines()
        summary = json.loads(lines[-1])
        replies = [line for line in lines if line.startswith("[frame-")]
        assert len(replies) == 2 and all("echo:image:" in line for line in replies)
        assert summary["replies"] == summary["sent"] == 2
        # ~0.9 s per reply at 20 fps: most frames arrive while one is in flight.
        assert summary["dropped"] >= 10
        assert summary["captured"] == summary["sent"] + summary["dropped"]
        assert "dropped" in err.getvalue()
        sent = [m for m in srv.received if isinstance(m, bytes)]
        assert len(sent) == 2 and all(
            m.startswith(b"\xff\xd8") and m.endswith(b"\xff\xd9") for m in sent
        )


async def test_pipeline_opens_a_new_session_when_the_server_ends_one() -> None:
    need_tool("ffmpeg", "apt-get install ffmpeg")
    async with fake_server(max_frame_bytes=1 << 20) as srv:
        # "fatal": every reply is followed by context_exceeded and session.closed.
        args = webcam.parse_args(
            [
                "--source", "testsrc", "--fps", "10", "--size", "64x48", "--prompt", "fatal",
                "--max-frames", "3", "--url", srv.url, "--json",
            ]
        )  # fmt: skip
        out, err = io.StringIO(), io.StringIO()
        assert await webcam.run(args, out, err, handle_signals=False) == 0, err.getvalue()
        summary = json.loads(out.getvalue().splitlines()[-1])
        assert summary["replies"] == 3 and summary["sessions"] == 3
        assert summary["statuses"] == {"failed": 3}
        assert err.getvalue().count("opening a new one") == 2
        args.reopen = False
        out, err = io.StringIO(), io.StringIO()
        assert await webcam.run(args, out, err, handle_signals=False) == 1
        assert "the session is closed" in err.getvalue()
        summary = json.loads(out.getvalue().splitlines()[-1])
        assert (summary["sent"], summary["replies"]) == (1, 1)
        assert summary["captured"] == summary["sent"] + summary["dropped"]


@pytest.mark.slow
async def test_webcam_script_end_to_end_with_ffmpeg_testsrc(client_server: RunningServer) -> None:
    need_tool("ffmpeg", "apt-get install ffmpeg")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the SDK
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WEBCAM),
        "--source", "testsrc", "--fps", "10", "--size", "112x112",
        "--prompt", "What changed?", "--window", "4", "--max-tokens", "4",
        "--max-frames", "5", "--url", client_server.url, "--api-key", CLIENT_KEY, "--json",
        cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    summary = json.loads(lines[-1])
    replies = [line for line in lines if line.startswith("[frame-")]
    assert len(replies) == 5, out.decode()
    assert all(" ms, " in line and "KV blocks)" in line for line in replies)
    assert summary["replies"] == summary["sent"] == 5 and summary["sessions"] == 1
    assert set(summary["statuses"]) <= {"completed", "incomplete"}
    assert summary["captured"] == summary["sent"] + summary["dropped"]
    assert summary["latency_ms"]["p50"] is not None and summary["skipped_bytes"] == 0
    assert "captured" in err.decode() and "dropped" in err.decode()
    for _ in range(100):
        if not client_server.hub.sessions:
            break
        await asyncio.sleep(0.05)
    assert not client_server.hub.sessions


async def test_webcam_reply_every_and_a_question_on_stdin(client_server: RunningServer) -> None:
    need_tool("ffmpeg", "apt-get install ffmpeg")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WEBCAM),
        "--source", "testsrc", "--fps", "10", "--size", "112x112",
        "--window", "4", "--max-tokens", "4", "--reply-every", "3",
        "--max-frames", "6", "--url", client_server.url, "--api-key", CLIENT_KEY, "--json",
        cwd=ROOT, env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(b"What is on screen?\n"), 120)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    summary = json.loads(lines[-1])
    frames = [line for line in lines if line.startswith("[frame-")]
    assert len(frames) == 6, out.decode()
    # Frames 2 and 5 (0-based) are answered, the others only watched.
    assert [("watched" in line) for line in frames] == [True, True, False, True, True, False]
    assert summary["watched"] == 4 and summary["statuses"]["ingested"] == 4
    assert summary["answers"] == 1
    assert any(line.startswith("[ask] What is on screen?") for line in lines), out.decode()
