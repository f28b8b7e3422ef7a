"""`SessionRetention.step_cap` and the idle-consolidation hint, without an engine (fakes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from retention.policy import REQUEST_ARGS_KEY, reprefill_pieces
from retention.vllm_adapter.eviction import RetentionConfigError, SessionRetention

# Needs no model runner: `make compat` also runs it against every supported vLLM.
pytestmark = pytest.mark.compat


def fake_request(request_id: str = "s", prompt: int = 40) -> Any:
    params = SimpleNamespace(
        extra_args={REQUEST_ARGS_KEY: {"sink_chunks": 1, "window_chunks": 2, "max_position": 300}}
    )
    return SimpleNamespace(
        request_id=request_id,
        resumable=True,
        sampling_params=params,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
    )


def test_a_reprefill_is_scheduled_in_repeating_pieces_then_uncapped() -> None:
    retention = SessionRetention(None, 32, 8192, reprefill_piece=128)
    request = fake_request()
    retention.on_new_request(request)
    state = retention.sessions["s"]
    # No re-prefill running: vLLM's figure stands (a chunk prefill, a decode step).
    assert retention.step_cap(request, 0, 300) == 300
    assert retention.step_cap(request, 40, 1) == 1
    state.reprefill_end = 300
    steps, done = [], 0
    while done < 300:
        steps.append(retention.step_cap(request, done, 300 - done))
        done += steps[-1]
    assert steps == reprefill_pieces(300, 128) == [128, 128, 32, 12]
    # vLLM's own smaller figure (token budget) wins.
    assert retention.step_cap(request, 0, 50) == 50
    # Requests without retention are never capped.
    assert retention.step_cap(fake_request("plain"), 0, 300) == 300


def test_piece_zero_is_one_step_and_bad_pieces_are_refused() -> None:
    retention = SessionRetention(None, 32, 8192, reprefill_piece=0)
    request = fake_request()
    retention.on_new_request(request)
    retention.sessions["s"].reprefill_end = 300
    assert retention.step_cap(request, 0, 300) == 300
    with pytest.raises(RetentionConfigError):
        SessionRetention(None, 32, 8192, reprefill_piece=96)


def test_idle_hint_follows_the_cursor_and_never_follows_a_control_chunk() -> None:
    retention = SessionRetention(None, 32, 8192)
    request = fake_request()
    retention.on_new_request(request)
    state = retention.sessions["s"]
    request.num_computed_tokens = 250
    assert not retention.idle_consolidation_due(request)  # no chunk size seen yet
    state.largest_incoming = 40
    assert not retention.idle_consolidation_due(request)  # 250 + 40 <= 300
    request.num_computed_tokens = 261
    assert retention.idle_consolidation_due(request)
    state.control_fold = True
    assert not retention.idle_consolidation_due(request)
