"""`vllm-realtime serve --model DIR` on a local checkpoint, with no other flag (but a port).

The checkpoint is a copy of `tiny-smolvlm` in a directory the server does not know as an
embedded model, so everything comes from the checkpoint itself: the prompt format and the image
placeholder from its chat template (realtime/prompt_format.py), the media caps from its
processor config (realtime/admission.py, `split_image_tokens`), the family from its config
(retention/vllm_adapter/model_families.py). A bounded video session runs on it through real
sockets, evicts, and a clip (which vLLM does not serve for SmolVLM) is refused clearly.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import websockets

from realtime.models import build_model
from tests.realtime.conftest import jpeg_bytes, open_session, recv_until
from tests.tools import served

pytestmark = pytest.mark.slow


async def test_serve_a_local_smolvlm_checkpoint_with_no_other_flag(tmp_path: Path) -> None:
    from realtime.models import registered_chat_format
    from tests.reliability.fuzzcore import _clip

    checkpoint = tmp_path / "my-smolvlm"
    shutil.copytree(build_model("tiny-smolvlm"), checkpoint)
    assert registered_chat_format(str(checkpoint)) is None  # not known as an embedded model
    async with served("--model", str(checkpoint)) as port:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        async with websockets.connect(url, subprotocols=["vllm-realtime"]) as ws:
            opened = await open_session(
                ws,
                modality="video",
                instructions="Describe each frame.",
                retention={"sink_chunks": 1, "window_chunks": 2},
                sampling={"max_tokens": 2},
            )
            assert opened["limits"]["model"] == str(checkpoint)
            # Sized from the processor config: a frame's media is at most 34 tokens (2x2 tiles
            # and the global image, splitting tokens included). Without it admission takes
            # 1,024 tokens a frame: a sink chunk and a window of two would be over 3,000.
            reservation = opened["reservation"]
            assert reservation["bounded"] and reservation["tokens"] < 1024, reservation
            for i in range(6):
                await ws.send(
                    json.dumps(
                        {
                            "type": "frame.append",
                            "image": base64.b64encode(jpeg_bytes(i)).decode(),
                            "prompt": "what is this?",
                        }
                    )
                )
                done, _ = await recv_until(ws, "response.done")
                assert done["status"] in ("completed", "incomplete"), done
                # The template's turns around the image's 34 tokens and the prompt.
                assert 34 < done["usage"]["prompt_tokens"] < 80, done["usage"]
            # Bounded: the sink chunk, the window of 2 and the chunk in flight; the evicted
            # frames' remnants (pieces sharing a block with a survivor) are counted in tokens.
            retention = done["retention"]
            assert retention["frames_retained"] == 4, retention
            assert retention["tokens_retained"] < 6 * done["usage"]["prompt_tokens"], retention
            assert retention["kv_blocks_held"] <= reservation["kv_blocks"], retention
            clip = base64.b64encode(_clip("mp4", "mpeg4", frames=4, size=64)).decode()
            await ws.send(json.dumps({"type": "frame.append", "video": clip}))
            err, _ = await recv_until(ws, "error")
            assert "video" in err["error"]["message"], err
            # The session goes on after the refused clip.
            await ws.send(
                json.dumps(
                    {"type": "frame.append", "image": base64.b64encode(jpeg_bytes(9)).decode()}
                )
            )
            done, _ = await recv_until(ws, "response.done")
            assert done["status"] in ("completed", "incomplete"), done


def _jpeg(width: int, height: int) -> str:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG")
    return base64.b64encode(buf.getvalue()).decode()


SMALL_POOL = ("--kv-cache-memory-bytes", str(256 << 20))


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
async def test_a_published_qwen_layout_serves_bounded_camera_sessions(
    tmp_path: Path, family: str
) -> None:
    """The family's tiny model with its published template and processor configs (12-16
    megapixel images, 16,384 tokens): it starts, a default camera session is bounded by the
    frame cap, a larger frame is resized down to it and says so, and a session's own cap
    reserves less."""
    from realtime.admission import media_bounds
    from realtime.engine_session import read_processor_config
    from realtime.media import DEFAULT_MAX_FRAME_PIXELS, fit_size
    from tests.published_layouts import published_checkpoint

    checkpoint = published_checkpoint(family, tmp_path)
    bounds = media_bounds(read_processor_config(str(checkpoint)), DEFAULT_MAX_FRAME_PIXELS)
    assert bounds is not None
    media = bounds.image_tokens  # 196 (Qwen3-VL: patch 16 × merge 2), 256 (patch 14)
    async with served("--model", str(checkpoint), *SMALL_POOL) as port:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        budget = {"sink_chunks": 1, "window_chunks": 2}
        async with websockets.connect(url, subprotocols=["vllm-realtime"]) as ws:
            opened = await open_session(ws, modality="video", retention=budget)
            cap = opened["limits"]["max_frame_pixels"]
            assert cap == DEFAULT_MAX_FRAME_PIXELS
            reservation = opened["reservation"]
            # Before the cap: "reserved as a whole context ... = 66144 tokens".
            assert reservation["bounded"], reservation
            prompts = []
            for width, height in [(640, 480), (1280, 720), (224, 224)]:
                frame = {"type": "frame.append", "image": _jpeg(width, height), "prompt": "?"}
                await ws.send(json.dumps(frame))
                done, _ = await recv_until(ws, "response.done")
                assert done["status"] in ("completed", "incomplete"), done
                prompts.append(done["usage"]["prompt_tokens"])
                if width == 1280:
                    # 1280×720 at 448×448 pixels, its aspect kept: 597×336.
                    assert done["resized"] == {
                        "from_size": [1280, 720],
                        "to_size": [597, 336],
                        "max_frame_pixels": cap,
                    }, done["resized"]
                elif width == 640:
                    assert done["resized"]["to_size"] == list(fit_size(640, 480, cap)), done
                else:
                    assert done["resized"] is None, done
            # The processor was told the cap: the 1280×720 frame is no more tokens than the
            # cap gives, its turn's text aside (the first chunk also carries Qwen2-VL's
            # default system turn).
            assert media * 0.9 < prompts[1] <= media + 40, (media, prompts)
            # Within 2× of the real peak: the sink chunk, a window of two and the chunk in
            # flight, each a camera frame and its 4-token reply.
            assert reservation["tokens"] <= 2 * 4 * (prompts[1] + 4), (reservation, prompts)
        async with websockets.connect(url, subprotocols=["vllm-realtime"]) as ws:
            small = await open_session(
                ws,
                modality="video",
                retention=budget,
                limits={"max_frame_pixels": 224 * 224},
            )
            assert small["reservation"]["tokens"] < reservation["tokens"], small
            await ws.send(json.dumps({"type": "frame.append", "image": _jpeg(640, 480)}))
            done, _ = await recv_until(ws, "response.done")
            assert done["resized"]["to_size"] == list(fit_size(640, 480, 224 * 224)), done
            assert done["usage"]["prompt_tokens"] < prompts[1], done


async def test_the_published_smolvlm_template_is_served_with_chat_template(tmp_path: Path) -> None:
    """SmolVLM's published template (read as lists only, the conversation opened once, the
    generation prompt a prefix of a past reply's opening) was refused at start; with
    `--chat-template FILE` it is served, its prompt as the template writes it. A frame cap of
    32×32 tells the processor a 32-px edge: one tile, the global image alone (7 tokens, not
    the 34 of 2×2 tiles)."""
    from tests.published_layouts import PUBLISHED

    checkpoint = tmp_path / "my-smolvlm"
    shutil.copytree(build_model("tiny-smolvlm"), checkpoint)
    template = PUBLISHED / "templates" / "smolvlm.jinja"
    async with served(
        "--model",
        str(checkpoint),
        "--chat-template",
        str(template),
        "--max-frame-pixels",
        "1024",
        *SMALL_POOL,
    ) as port:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        async with websockets.connect(url, subprotocols=["vllm-realtime"]) as ws:
            opened = await open_session(
                ws, modality="video", retention={"sink_chunks": 1, "window_chunks": 2}
            )
            assert opened["reservation"]["bounded"], opened
            for i in range(4):
                await ws.send(
                    json.dumps(
                        {"type": "frame.append", "image": _jpeg(64 + i, 48), "prompt": "what?"}
                    )
                )
                done, _ = await recv_until(ws, "response.done")
                assert done["status"] in ("completed", "incomplete"), done
                assert done["resized"] is not None, done  # 64×48 and up, over 32×32
                # The global image (7 tokens) and the turn's text; 2×2 tiles alone are 34.
                assert done["usage"]["prompt_tokens"] < 30, done["usage"]


@pytest.mark.parametrize("family", ["smolvlm", "smolvlm2"])
async def test_a_published_smolvlm_256m_layout_is_served_end_to_end(
    tmp_path: Path, family: str
) -> None:
    """SmolVLM-256M-Instruct's layout (its template, preprocessor_config.json with 512-px
    tiles and a 2,048-px edge, processor_config.json with `image_seq_len` 64 alone) on a tiny
    model of its geometry, with no flag but the pool: it starts, the caps come from the right
    file, and a default camera session is bounded at one tile a frame (the default cap)."""
    from tests.published_layouts import published_smolvlm

    # SmolVLM2-256M/500M-Video's layout: the same tiles, its clip sampling in the same file.
    checkpoint = published_smolvlm(tmp_path, family)
    async with served("--model", str(checkpoint), *SMALL_POOL) as port:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        async with websockets.connect(url, subprotocols=["vllm-realtime"]) as ws:
            opened = await open_session(
                ws, modality="video", retention={"sink_chunks": 1, "window_chunks": 2}
            )
            assert opened["reservation"]["bounded"], opened
            for width, height in [(224, 224), (640, 480), (1280, 720)]:
                frame = {"type": "frame.append", "image": _jpeg(width, height), "prompt": "?"}
                await ws.send(json.dumps(frame))
                done, _ = await recv_until(ws, "response.done")
                assert done["status"] in ("completed", "incomplete"), done
                # The global image (64 + 3 tokens) and the turn's text; uncapped, the
                # processor makes 4×4 tiles of a 224-px frame: 1,128 tokens.
                assert 67 < done["usage"]["prompt_tokens"] < 67 + 30, done["usage"]
