"""A bounded mRoPE video session preempted while a plain request competes (tiny Qwen2-VL,
prefix caching on): it resumes as a fresh prefill of what it held.

The state after the resume (eviction.py `on_preempted`, preemption.py): the held tokens are
renumbered 0..n-1 and recomputed with the positions stock vLLM gives a fresh prompt over them
(`get_mrope_input_positions` over the held tokens and the held items), the hash chain is
rebuilt over the compacted tokens. A remnant (the tokens of an evicted chunk that shared a
block with a survivor) may hold placeholder tokens of an item that was dropped with its chunk:
it has no features any more, so the recompute embeds and positions them as plain text tokens.

Checked, as for the text sessions in test_preemption.py:

(a) the next chunk's reply equals a dense transformers forward over the resumed state: every
    held token and the preempted chunk causal at transformers' own 3-D positions for that
    sequence (held items as images, orphaned placeholders as text), the next chunk seeing what
    the cache holds after its fold; log-probs within 1e-4, argmax equal;
(b) plain requests whose prompt is the session's ORIGINAL prefix (its first frame included),
    or a prefix of its compacted content (orphaned placeholders read as text, as the session
    does), get what a request that reads no cache computes, while the session lives and after
    it closed; the second hits the blocks the resume published;
(c) every block is back at close.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from retention.vllm_adapter.introspect import kv_stats, retention_state
from tests.retention.test_preemption import probe_matches_cold
from tests.retention.test_video_retention import (
    TOLERANCE,
    Chunk,
    VideoSession,
    compare,
    hf_vlm,  # noqa: F401  (module fixture)
    make_chunk,
    processor,  # noqa: F401  (module fixture)
    wait_all_blocks_free,
)

pytestmark = pytest.mark.slow


def media_token_ids(model: Any) -> tuple[int, int]:
    return int(model.config.image_token_id), int(model.config.video_token_id)


def dense_logprobs(
    model: Any,
    tokens: list[int],
    items: list[tuple[int, Chunk]],
    visible: list[list[int]],
    rows: list[int],
) -> Any:
    """Log-probs after each of `rows`, for `tokens` where each of `items` (start offset, chunk)
    is a held image or clip at its placeholders; any other placeholder token is text."""
    import torch

    image_id, video_id = media_token_ids(model)
    n = len(tokens)
    ids = torch.tensor([tokens])
    types = torch.zeros((1, n), dtype=torch.int)
    embeds = model.get_input_embeddings()(ids).clone()
    grids: dict[str, list[Any]] = {"image": [], "video": []}
    for start, chunk in items:
        pad = image_id if chunk.kind == "image" else video_id
        span = [start + k for k, t in enumerate(chunk.token_ids) if t == pad]
        assert all(tokens[p] == pad for p in span)
        with torch.no_grad():
            if chunk.kind == "image":
                out = model.model.get_image_features(chunk.pixel_values, chunk.grid_thw)
            else:
                out = model.model.get_video_features(chunk.pixel_values, chunk.grid_thw)
        features = torch.cat(list(out.pooler_output))
        assert features.shape[0] == len(span)
        embeds[0, span] = features.to(embeds.dtype)
        types[0, span] = 1 if chunk.kind == "image" else 2
        grids[chunk.kind].append(chunk.grid_thw)
    image_grid = torch.cat(grids["image"]) if grids["image"] else None
    video_grid = torch.cat(grids["video"]) if grids["video"] else None
    positions, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=image_grid, video_grid_thw=video_grid
    )
    mask = torch.full((1, 1, n, n), float("-inf"))
    for j, seen in enumerate(visible):
        mask[0, 0, j, seen] = 0.0
    with torch.no_grad():
        out = model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask)
    return torch.log_softmax(out.logits[0, rows].float(), dim=-1)


async def send(
    session: VideoSession,
    chunk_prompt: str,
    chunk: Chunk,
    *,
    max_tokens: int,
    preempt_after_first_token: bool = False,
) -> tuple[list[int], list[dict[int, float]]]:
    """One chunk with its own max_tokens; optionally preempt the session while it decodes."""
    from vllm.engine.protocol import StreamingInput

    params = session.params.clone()
    params.max_tokens = max_tokens
    p: dict[str, Any] = {"prompt": chunk_prompt}
    if chunk.multi_modal_data is not None:
        p["multi_modal_data"] = chunk.multi_modal_data
    session.inputs.put_nowait(StreamingInput(prompt=p, sampling_params=params))
    tokens: list[int] = []
    logprobs: list[dict[int, float]] = []
    preempted = False
    while True:
        out = await session.outputs.__anext__()
        assert not out.finished, "a retention session must not end on its own"
        completion = out.outputs[0]
        tokens.extend(completion.token_ids)
        for entry in completion.logprobs or []:
            logprobs.append({tok: lp.logprob for tok, lp in entry.items()})
        if completion.finish_reason is not None:
            return tokens, logprobs
        if preempt_after_first_token and tokens and not preempted:
            preempted = True
            assert await session.engine.reset_prefix_cache(reset_running_requests=True)


async def test_preempted_video_session_resumes_as_a_fresh_prefill(
    vlm_engine: Any,
    hf_vlm: Any,  # noqa: F811
    processor: Any,  # noqa: F811
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = vlm_engine
    stats = await kv_stats(engine)
    assert stats["prefix_caching"], "these tests need prefix caching on"
    usable = stats["num_usable_blocks"]
    image_id, video_id = media_token_ids(hf_vlm)
    budget = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
    session = VideoSession(engine, budget)
    chunks: list[Chunk] = []
    replies: list[list[int]] = []
    probes: list[tuple[list[int], dict[str, Any] | None]] = []
    try:
        for i in range(7):
            chunk_prompt, chunk = make_chunk(processor, i, seed=500, video_every=3)
            reply, _ = await session.send(chunk_prompt, chunk.multi_modal_data)
            chunks.append(chunk)
            replies.append(reply)
        before = await retention_state(engine, session.request_id)
        assert before is not None and before["tokens_evicted"] > 0, "evict before preempting"

        # The chunk preempted while it decodes, a plain request running beside it.
        async def competitor() -> None:
            params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
            words = processor.tokenizer("a plain request beside it " * 16)["input_ids"]
            prompt = TokensPrompt(prompt_token_ids=list(words)[:80])
            async for _ in engine.generate(prompt, params, request_id=f"c-{uuid.uuid4().hex[:6]}"):
                pass

        rival = asyncio.create_task(competitor())
        chunk_prompt, chunk = make_chunk(processor, 7, seed=500)
        reply, _ = await asyncio.wait_for(
            send(session, chunk_prompt, chunk, max_tokens=24, preempt_after_first_token=True), 600
        )
        await asyncio.wait_for(rival, 600)
        chunks.append(chunk)
        replies.append(reply)
        state = await retention_state(engine, session.request_id)
        assert state is not None
        assert state["preemptions"] >= 1, "the session was not preempted"
        held = state["token_ids"]
        assert state["history_positions"] == list(range(len(held)))

        # The resumed state: held tokens (whole survivors carry their item), then the
        # preempted chunk and its reply, all causal from 0.
        items: list[tuple[int, Chunk]] = []
        orphans = 0
        for index, _kind, start, end, remnant in state["segment_chunks"]:
            pads = sum(1 for t in held[start:end] if t in (image_id, video_id))
            if remnant:
                orphans += pads
            elif chunks[index].pixel_values is not None:
                items.append((start, chunks[index]))
        fresh = [*held, *chunk.token_ids, *reply[:-1]]
        items.append((len(held), chunk))
        # (a) The next chunk sees what the cache holds after its fold.
        chunk_prompt, nxt = make_chunk(processor, 8, seed=500)
        _, logprobs = await send(session, chunk_prompt, nxt, max_tokens=2)
        after = await retention_state(engine, session.request_id)
        assert after is not None
        cursor = after["position_cursor"]
        assert cursor == len(fresh), (cursor, len(fresh))
        visible = [list(range(j + 1)) for j in range(len(fresh))]
        visible += [
            after["history_positions"] + list(range(cursor, cursor + j + 1))
            for j in range(len(nxt.token_ids))
        ]
        want = dense_logprobs(
            hf_vlm,
            [*fresh, *nxt.token_ids],
            [*items, (cursor, nxt)],
            visible,
            [len(fresh) + len(nxt.token_ids) - 1],
        )
        worst = compare(logprobs[0], want[0], "after resume")
        print(f"video preemption oracle: max |Δ logprob| = {worst:.2e}, orphans {orphans}")
        assert worst < TOLERANCE

        # (b) Probes: the original prefix through the first frame, and the compacted content
        # up to its first held item (each a valid plain prompt: whole items, at most one).
        first_frame = [*chunks[0].token_ids, *replies[0][:-1], *chunks[1].token_ids]
        probes.append((first_frame, chunks[1].multi_modal_data))
        # The compacted content up to its first held item: sinks and remnants, orphaned
        # placeholders included (a plain prompt without media reads them as text, as the
        # resumed session does), so the block hashes match the resume's rebuilt chain.
        probes.append((fresh[: items[0][0]], None))
        cached = [await probe_matches_cold(engine, t, m) for t, m in probes]
        print("probe cached tokens:", cached, "lengths:", [len(t) for t, _ in probes])
        # The resume published its recomputed blocks (rebuilt chain): the second probe hits.
        assert cached[1] >= 32, cached
    finally:
        await session.close()
    for t, m in probes:
        await probe_matches_cold(engine, t, m)
    # (c) Every block is back.
    stats = await wait_all_blocks_free(engine)
    assert stats["num_free_blocks"] == usable
