"""Issue #19 on the real engines: ingested chunks (reply: false), questions in video sessions,
structured replies.

The no-phantom-token oracle drives SmolLM2-135M (float32) through the server's own prompt
rendering and per-chunk SamplingParams (`render_chunk`, `EngineSession.chunk_params`), without
retention eviction, so every token keeps its position: after answered and ingested chunks, the
session's cumulative prompt must be exactly the chunks' tokens plus the kept reply tokens, and
the next-token log-probabilities must equal a dense transformers forward over those tokens
(vLLM's CPU kernels and eager attention differ by ~1e-5; one stray token moves them by > 0.1).
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from typing import Any

import pytest
import websockets

from realtime.engine_session import EngineSession, chat_format_of, render_chunk
from realtime.models import model_dir
from tests.realtime.conftest import SUBPROTOCOLS, jpeg_bytes, open_session, recv, recv_until
from vllm_realtime_protocol import Frame, SamplingConfig, SessionConfig

pytestmark = pytest.mark.slow

TOLERANCE = 2e-3
TOP_K = 5


def text_frame(i: int, text: str, *, reply: bool) -> Frame:
    return Frame(
        frame_index=i,
        frame_id=None,
        kind="text",
        media_format=None,
        data=text.encode(),
        text=text,
        prompt=None,
        timestamp=None,
        reply=reply,
    )


class Driver:
    """One streaming session fed chunk by chunk, keeping each chunk's prompt ids and logprobs."""

    def __init__(self, engine: Any) -> None:
        self.es = EngineSession(
            engine, f"watch-{uuid.uuid4().hex[:12]}", SamplingConfig(max_tokens=4, temperature=0.0)
        )
        self.engine = engine
        self.inputs: asyncio.Queue[Any] = asyncio.Queue()
        self.outputs: Any = None
        self.config = SessionConfig(modality="text")
        self.chat = chat_format_of(engine)

    async def _stream(self) -> Any:
        while True:
            yield await self.inputs.get()

    async def send(self, frame: Frame) -> tuple[str, list[int], list[dict[int, float]], int]:
        from vllm.engine.protocol import StreamingInput

        prompt = render_chunk(
            frame,
            self.config,
            chat=self.chat,
            first=self.es.chunks == 0,
            multimodal=False,
            after_reply=self.es.turn_open,
        )
        params = self.es.chunk_params(reply=frame.reply)
        if frame.reply:
            params.logprobs = TOP_K
        self.inputs.put_nowait(StreamingInput(prompt=prompt, sampling_params=params))
        if self.outputs is None:
            self.outputs = self.engine.generate(
                self._stream(), params, request_id=self.es.request_id
            )
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []
        while True:
            out = await self.outputs.__anext__()
            completion = out.outputs[0]
            tokens.extend(completion.token_ids)
            for entry in completion.logprobs or []:
                logprobs.append({tok: lp.logprob for tok, lp in entry.items()})
            if completion.finish_reason is not None:
                self.es.chunks += 1
                self.es.turn_open = frame.reply
                return prompt["prompt"], tokens, logprobs, len(out.prompt_token_ids or [])

    async def close(self) -> None:
        if self.outputs is not None:
            await self.outputs.aclose()
        await self.engine.abort(self.es.request_id)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir("smollm2-135m-instruct")), dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir("smollm2-135m-instruct")))


async def test_ingested_chunks_leave_no_generated_token(
    smollm2_engine: Any, hf_model: Any, tokenizer: Any
) -> None:
    import torch

    d = Driver(smollm2_engine)
    expected: list[int] = []
    try:
        # An answered chunk first: its reply (but the last sampled token) stays in the context.
        prompt, reply, _, held = await d.send(text_frame(0, "Say hello.", reply=True))
        expected += tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert len(reply) == 4  # measured: no EOS within 4 tokens; 3 are kept
        expected += reply[:-1]
        for i in range(1, 9):
            prompt, sampled, lps, held = await d.send(
                text_frame(i, f"Frame {i}: the hallway is empty.", reply=False)
            )
            assert len(sampled) == 1  # one token sampled to end the chunk ...
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if i == 1:
                # ... the answered chunk's turn is closed by the first ingested one ...
                assert prompt.startswith("<|im_end|>\n<|im_start|>user\n")
            else:
                # ... and an ingested chunk opens no assistant turn, so nothing needs closing.
                assert prompt.startswith("<|im_start|>user\n")
            assert not prompt.endswith("<|im_start|>assistant\n")
            expected += ids
        prompt, answer, lps, held = await d.send(
            text_frame(9, "What does the hallway look like?", reply=True)
        )
        expected += tokenizer(prompt, add_special_tokens=False)["input_ids"]
        # The front end counts the chunks' prompts only (not the kept reply tokens): 3 fewer.
        assert held == len(expected) - 3, (held, len(expected))
        with torch.no_grad():
            logits = hf_model(
                input_ids=torch.tensor([expected]),
                position_ids=torch.arange(len(expected))[None],
            ).logits[0, -1]
        want = torch.log_softmax(logits.float(), dim=-1)
        got = lps[0]
        # The engine's context is exactly the chunks and the first reply's kept tokens: had
        # any of the 8 tokens sampled to end the ingested chunks entered it, the positions and
        # the attended tokens would differ and the log-probabilities with them.
        assert answer[0] == int(torch.argmax(want))
        for tok, lp in got.items():
            assert abs(lp - float(want[tok])) < TOLERANCE, (tok, lp, float(want[tok]))
    finally:
        await d.close()


async def test_watch_then_ask_in_a_video_session(server: Any) -> None:
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws, sampling={"max_tokens": 4})
        for i in range(6):
            image = base64.b64encode(jpeg_bytes(i)).decode()
            await ws.send(
                json.dumps(
                    {"type": "frame.append", "image": image, "reply": False, "frame_id": f"f{i}"}
                )
            )
            done, seen = await recv_until(ws, "response.done")
            # Only the ack and the done: no response.created, no delta.
            assert [e["type"] for e in seen] == ["input.ack", "response.done"], seen
            assert done["status"] == "ingested" and done["text"] == ""
            assert done["frame_id"] == f"f{i}" and done["usage"]["completion_tokens"] == 0
            assert done["usage"]["prompt_tokens"] > 0
        await ws.send(
            json.dumps({"type": "frame.append", "text": "What happened?", "frame_id": "q"})
        )
        done, seen = await recv_until(ws, "response.done")
        types = [e["type"] for e in seen]
        assert types[:2] == ["input.ack", "response.created"], types
        assert done["frame_id"] == "q" and done["status"] in ("completed", "incomplete")
        assert done["usage"]["completion_tokens"] >= 1
        # The window holds the frames and the question: the default window_chunks (8) was
        # not passed by 7 chunks.
        assert done["retention"]["frames_retained"] == 7, done["retention"]


SCHEMA = {
    "type": "object",
    "properties": {
        "person": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
    },
    "required": ["person", "level"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}}


async def test_structured_replies_valid_over_50_frames(server: Any) -> None:
    import jsonschema

    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        # The longest reply the schema allows, {"person":false,"level":"high"}, is 31
        # characters: at most 31 tokens and EOS even if the model spells it byte by byte, so
        # 48 tokens leave every reply room to finish. (The earlier "escape" was a reply cut by
        # max_tokens 24 after '{"person":false,"level":"l', reported as incomplete.)
        await open_session(ws, sampling={"max_tokens": 48, "response_format": JSON_SCHEMA_FORMAT})
        statuses: dict[str, int] = {}
        for i in range(50):
            image = base64.b64encode(jpeg_bytes(i)).decode()
            # Every fifth frame is only watched: the grammar must not leak into it, and the
            # next answered frame must get its grammar back.
            reply = i % 5 != 4
            await ws.send(json.dumps({"type": "frame.append", "image": image, "reply": reply}))
            done, _ = await recv_until(ws, "response.done")
            statuses[done["status"]] = statuses.get(done["status"], 0) + 1
            if reply:
                assert done["status"] == "completed", (i, done)
                jsonschema.validate(json.loads(done["text"]), SCHEMA)
            else:
                assert done["status"] == "ingested"
        assert statuses == {"completed": 40, "ingested": 10}, statuses
        # Per-chunk override: a json_object reply, then free text again.
        await ws.send(
            json.dumps(
                {
                    "type": "frame.append",
                    "text": "Describe it.",
                    "response_format": {"type": "json_object"},
                }
            )
        )
        done, _ = await recv_until(ws, "response.done")
        if done["status"] == "completed":
            assert isinstance(json.loads(done["text"]), dict)
        else:  # a random-weight model may write keys until max_tokens
            assert (done["status"], done["status_reason"]) == ("incomplete", "max_tokens"), done
        # And back to the session's schema.
        image = base64.b64encode(jpeg_bytes(99)).decode()
        await ws.send(json.dumps({"type": "frame.append", "image": image}))
        done, _ = await recv_until(ws, "response.done")
        assert done["status"] == "completed", done
        jsonschema.validate(json.loads(done["text"]), SCHEMA)


async def test_structured_reply_cut_by_max_tokens_is_incomplete(server: Any) -> None:
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws, sampling={"max_tokens": 3, "response_format": JSON_SCHEMA_FORMAT})
        image = base64.b64encode(jpeg_bytes(1)).decode()
        await ws.send(json.dumps({"type": "frame.append", "image": image}))
        done, _ = await recv_until(ws, "response.done")
        # {"person":… needs more than 3 tokens.
        assert done["status"] == "incomplete" and done["status_reason"] == "max_tokens", done


async def test_invalid_schema_refused_at_open(server: Any) -> None:
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        hello = await recv(ws)
        assert hello["type"] == "session.created"
        bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "banana"}}}
        await ws.send(
            json.dumps(
                {"type": "session.open", "event_id": "o1", "sampling": {"response_format": bad}}
            )
        )
        err = await recv(ws)
        assert err["type"] == "error", err
        assert err["error"]["code"] == "invalid_request" and err["error"]["event_id"] == "o1"
        assert "not a valid JSON Schema" in err["error"]["message"]
        assert err["error"]["session_survives"] is True
        # The connection is still usable: a valid open goes through.
        await ws.send(json.dumps({"type": "session.open", "sampling": {"max_tokens": 2}}))
        assert (await recv(ws))["type"] == "session.opened"
