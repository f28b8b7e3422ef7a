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
