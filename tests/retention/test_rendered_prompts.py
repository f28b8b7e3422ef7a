"""A session's chunks reach vLLM rendered (retention/vllm_adapter/rendering.py), and answer as
the raw prompts vLLM rendered itself did.

Oracle: the same bounded video session (text, images, a clip, evictions) run twice on one engine,
once as served (each chunk rendered by `render_prompt`) and once with the raw prompts handed to
vLLM, gives the same greedy tokens with the same log-probabilities. Every prompt vLLM's
`process_inputs` receives is recorded: as served, the only raw one is vLLM's own validation
request (`TokensPrompt([0])`, built inside `AsyncLLM._add_streaming_input_request`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

import realtime.engine_session as engine_session
from realtime.engine_session import ChunkDelta, ChunkFinished, EngineSession
from retention.vllm_adapter.rendering import is_rendered
from tests.retention.vlm_oracle import SYSTEM, TokenLog, frame_clip, frame_image, frame_prompt
from vllm_realtime_protocol import SamplingConfig

pytestmark = pytest.mark.slow

BUDGET = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
VALIDATION_PROMPT = {"prompt_token_ids": [0]}


@pytest.fixture
def received(vlm_engine: Any) -> Iterator[list[Mapping[str, Any]]]:
    """Every prompt vLLM's input processor is given while the test runs."""
    processor = vlm_engine.input_processor
    original = processor.process_inputs
    prompts: list[Mapping[str, Any]] = []

    def recording(request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        prompts.append(prompt)
        return original(request_id, prompt, *args, **kwargs)

    processor.process_inputs = recording
    try:
        yield prompts
    finally:
        del processor.process_inputs


def chunks() -> list[dict[str, Any]]:
    """Text, four images and a clip: six chunks, so a 2-chunk window evicts."""
    out: list[dict[str, Any]] = [{"prompt": SYSTEM + "<|im_start|>user\nWatch.<|im_end|>\n"}]
    for i in range(4):
        out.append({"prompt": frame_prompt(i), "multi_modal_data": {"image": frame_image(i)}})
    out.append({"prompt": frame_prompt(4, "video"), "multi_modal_data": {"video": frame_clip(4)}})
    return out


async def run_session(engine: Any) -> list[tuple[int, float]]:
    log = TokenLog(engine)
    es = EngineSession(
        log,
        f"render-{uuid.uuid4().hex[:12]}",
        SamplingConfig(max_tokens=4, temperature=0.0),
        dict(BUDGET),
        idle_consolidation=False,
    )
    try:
        for prompt in chunks():
            finished = None
            async for item in es.run_chunk(prompt, es.chunk_params(reply=True, kind="frame")):
                if isinstance(item, ChunkFinished):
                    finished = item
                else:
                    assert isinstance(item, ChunkDelta)
            assert finished is not None
    finally:
        await es.abort()
    return list(zip(log.ids, log.logprobs, strict=True))


async def test_rendered_chunks_answer_as_raw_prompts_and_vllm_gets_only_rendered_ones(
    vlm_engine: Any, received: list[Mapping[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    served = await run_session(vlm_engine)
    raw_served = [p for p in received if not is_rendered(p)]
    assert raw_served == [VALIDATION_PROMPT]
    assert sum(1 for p in received if is_rendered(p)) == len(chunks())

    async def unrendered(engine: Any, prompt: Mapping[str, Any]) -> Mapping[str, Any]:
        return prompt

    monkeypatch.setattr(engine_session, "render_prompt", unrendered)
    received.clear()
    raw = await run_session(vlm_engine)
    # The check discriminates: without rendering, every chunk reaches vLLM raw.
    assert sum(1 for p in received if not is_rendered(p)) == len(chunks()) + 1

    assert [tok for tok, _ in served] == [tok for tok, _ in raw]
    worst = max(abs(a - b) for (_, a), (_, b) in zip(served, raw, strict=True))
    print("rendered vs raw: tokens", len(served), "max |Δ logprob|", worst)
    assert worst <= 1e-5
