"""The eviction oracle on a published layout (issue #47): tiny-qwen3-vl carrying Qwen3-VL-8B-
Instruct's template and processor configs (tests/published/), its engine told the frame cap as
`serve` tells it (`EngineSettings.max_frame_pixels` → `mm_processor_kwargs`), checked as
tests/retention/test_mrope_families.py checks the tiny config: transformers' own forward over
the session's actual cache contents, log-probs within 1e-4 and argmax equal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from realtime.media import DEFAULT_MAX_FRAME_PIXELS
from tests.conftest import engine_settings
from tests.published_layouts import published_checkpoint
from tests.retention.vlm_oracle import Media, drive_and_check, wait_all_blocks_free

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return published_checkpoint("qwen3-vl", tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="module")
async def engine(checkpoint: Path) -> AsyncIterator[Any]:
    from realtime.engine import start_engine

    engine = start_engine(
        engine_settings(
            str(checkpoint),
            max_frame_pixels=DEFAULT_MAX_FRAME_PIXELS,
            max_model_len=2048,
            extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
        )
    )
    yield engine
    engine.shutdown()


async def test_eviction_on_the_published_qwen3_vl_layout_matches_oracle(
    engine: Any, checkpoint: Path
) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    hf_vlm = AutoModelForImageTextToText.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # The published processor, told the server's cap as the engine is.
    processor = AutoProcessor.from_pretrained(
        str(checkpoint), size={"longest_edge": DEFAULT_MAX_FRAME_PIXELS, "shortest_edge": 65536}
    )
    budget = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
    # 640-px frames, above the cap: the engine's processor resizes them to it (196 tokens), as
    # the oracle's does; a processor not told the cap would make 400 tokens and diverge.
    report = await drive_and_check(
        engine, hf_vlm, processor, budget, num_frames=6, media=Media(image_size=640)
    )
    assert report["evicted_checks"] >= 2, report
    assert report["state"]["evictions"] >= 1
    stats = await wait_all_blocks_free(engine)
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]
