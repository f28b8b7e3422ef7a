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

from typing import Any

import pytest

from tests.retention.vlm_oracle import preempt_and_check

pytestmark = pytest.mark.slow


@pytest.mark.v2
async def test_preempted_video_session_resumes_as_a_fresh_prefill(
    vlm_engine: Any,
    hf_vlm: Any,
    processor: Any,
) -> None:
    report = await preempt_and_check(vlm_engine, hf_vlm, processor)
    print(
        f"video preemption oracle: max |Δ logprob| = {report['max_diff']:.2e}, "
        f"orphans {report['orphans']}, probe cached tokens {report['cached']}"
    )
