"""The text-session driver and oracles shared by the SmolLM2 retention tests.

`Session` drives one retention session chunk by chunk; `masked_logprobs` and `hf_logprobs` are
the dense transformers oracles (test_text_retention.py's docstring says why the mask);
`probe_matches_cold` checks that a plain request reading the cache gets what a cold one does
(test_preemption.py's (b))."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from retention.records import SessionReport
from retention.selfcheck import TEXT_TOLERANCE, dense_logprobs
from retention.selfcheck import masked_logprobs as masked_logprobs

TOLERANCE = TEXT_TOLERANCE
TOP_K = 5


def note_worst_delta(test: str, worst: float) -> None:
    """The worst |Δ log-prob| a test saw against its oracle, on this process's runner (shown
    with `pytest -s`; docs/history/v2-runner.md compares V1 and V2)."""
    from tests.model_runner_mode import RUNNER

    print(f"\nWORST-DELTA {test} runner={RUNNER} {worst:.3e}")


hf_logprobs = dense_logprobs


class Session:
    """A retention session driven chunk by chunk (one chunk in flight, as the server does)."""

    def __init__(self, engine: Any, budget: dict[str, Any], max_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.request_id = f"retention-{uuid.uuid4().hex[:12]}"
        self.inputs: asyncio.Queue[Any] = asyncio.Queue()
        self.params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=TOP_K,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"streaming_retention": budget},
        )
        self.outputs: Any = None
        # EngineCore's report on the output that closed the last chunk.
        self.report: SessionReport | None = None

    async def _stream(self) -> AsyncIterator[Any]:
        while True:
            item = await self.inputs.get()
            if item is None:
                return
            yield item

    async def send(self, token_ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        self.inputs.put_nowait(StreamingInput(prompt=TokensPrompt(prompt_token_ids=token_ids)))
        if self.outputs is None:
            self.outputs = self.engine.generate(
                self._stream(), self.params, request_id=self.request_id
            )
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []
        while True:
            out = await self.outputs.__anext__()
            assert not out.finished, "a retention session must not end on its own"
            completion = out.outputs[0]
            tokens.extend(completion.token_ids)
            for entry in completion.logprobs or []:
                logprobs.append({tok: lp.logprob for tok, lp in entry.items()})
            if completion.finish_reason is not None:
                self.report = SessionReport.from_wire(out.kv_transfer_params)
                return tokens, logprobs

    async def close(self) -> None:
        if self.outputs is not None:
            await self.outputs.aclose()
        await self.engine.abort(self.request_id)


def chunk_tokens(tokenizer: Any, i: int) -> list[int]:
    text = f"Note {i}: the river carried {i % 7} boats past the old mill at dawn."
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


PROBE_TOLERANCE = 1e-4


async def plain(
    engine: Any,
    prompt: list[int],
    *,
    max_tokens: int = 4,
    read_cache: bool = True,
    multi_modal_data: dict[str, Any] | None = None,
) -> tuple[list[int], list[dict[int, float]], int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=5,
        ignore_eos=True,
        skip_reading_prefix_cache=not read_cache,
    )
    request = TokensPrompt(prompt_token_ids=prompt)
    if multi_modal_data is not None:
        request["multi_modal_data"] = multi_modal_data
    final: Any = None
    async for out in engine.generate(request, params, request_id=f"plain-{uuid.uuid4().hex[:8]}"):
        final = out
    completion = final.outputs[0]
    lps = [{t: lp.logprob for t, lp in entry.items()} for entry in completion.logprobs]
    return list(completion.token_ids), lps, int(final.num_cached_tokens or 0)


async def probe_matches_cold(
    engine: Any, prompt: list[int], multi_modal_data: dict[str, Any] | None = None
) -> int:
    """(b): the probe equals a run that reads no cache; returns the tokens it found cached."""
    tokens, lps, cached = await plain(engine, prompt, multi_modal_data=multi_modal_data)
    cold_tokens, cold_lps, _ = await plain(
        engine, prompt, read_cache=False, multi_modal_data=multi_modal_data
    )
    assert tokens == cold_tokens, (len(prompt), cached, tokens, cold_tokens)
    for got, want in zip(lps, cold_lps, strict=True):
        for tok, lp in got.items():
            if tok in want:
                assert abs(lp - want[tok]) < PROBE_TOLERANCE, (tok, lp, want[tok])
    return cached
