"""The covered model families (retention/vllm_adapter/model_families.py) and the refusal of others.

The table must name, for every family, tests that exist; any other family is refused by name
with a reason. The refusal is shown on a real family vLLM serves: a tiny random Gemma 3 (text),
whose layers mix sliding-window and full attention, built here in seconds. vLLM answers a plain
request on it; the server refuses to start on it, and a bounded session opened on the engine
directly is ended with `retention_unsupported` and the same reason.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from retention.vllm_adapter.model_families import (
    COVERED_FAMILIES,
    FAMILIES,
    UncoveredModelFamily,
    check_model_family,
    family_problem,
    readme_table,
    stores_frames,
)

REPO = Path(__file__).resolve().parents[2]


def test_every_covered_family_names_tests_that_exist() -> None:
    for family in COVERED_FAMILIES:
        assert family.proven_by, family
        for path in family.proven_by:
            assert (REPO / path).is_file(), (family.architecture, path)
    assert len(FAMILIES) == len(COVERED_FAMILIES)


def test_the_readme_family_table_is_the_generated_one() -> None:
    assert readme_table() in (REPO / "README.md").read_text(), (
        "README.md's family table differs from model_families.readme_table(): paste it in"
    )


def test_storability_is_the_tables_column() -> None:
    assert [f.architecture for f in COVERED_FAMILIES if f.stores_frames] == [
        "Qwen2VLForConditionalGeneration"
    ]
    assert stores_frames(["Qwen2VLForConditionalGeneration"])
    assert not stores_frames(["Qwen3VLForConditionalGeneration"])
    assert not stores_frames(["MistralForCausalLM"]) and not stores_frames(None)


def test_the_embedded_models_are_covered_with_their_position_scheme() -> None:
    import json

    from realtime.models import DEFAULT_MODELS, build_model

    for name in DEFAULT_MODELS:
        config = json.loads((build_model(name) / "config.json").read_text())
        (arch,) = config["architectures"]
        uses_mrope = "mrope_section" in json.dumps(config)
        assert family_problem([arch], uses_mrope=uses_mrope) is None, name
        assert FAMILIES[arch].positions == ("mRoPE" if uses_mrope else "1D"), name


def test_an_uncovered_family_is_refused_by_name_with_its_reason() -> None:
    text = SimpleNamespace(model_type="mistral", layer_types=None, sliding_window=None)
    problem = family_problem(["MistralForCausalLM"], uses_mrope=False, hf_config=text)
    assert problem is not None
    assert "MistralForCausalLM (model_type 'mistral') is not covered" in problem
    assert "no oracle test runs bounded sessions on it" in problem
    assert "SmolVLM" in problem and "Qwen2-VL (mRoPE)" in problem  # what is covered
    hybrid = SimpleNamespace(
        model_type="gemma3_text",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
    )
    problem = family_problem(["Gemma3ForCausalLM"], uses_mrope=False, hf_config=hybrid)
    assert problem is not None and "full_attention, sliding_attention" in problem
    vlm = SimpleNamespace(model_type="llava", layer_types=None, sliding_window=None)
    problem = family_problem(
        ["LlavaForConditionalGeneration"], uses_mrope=False, multimodal=True, hf_config=vlm
    )
    assert problem is not None and "multimodal placeholders" in problem
    # A covered architecture whose config asks for the other position scheme.
    problem = family_problem(["LlamaForCausalLM"], uses_mrope=True)
    assert problem is not None and "covered with 1D positions" in problem
    assert family_problem(["LlamaForCausalLM", "Qwen2VLForConditionalGeneration"], uses_mrope=False)


def build_tiny_gemma3(out: Path) -> None:
    """A random Gemma 3 text model (2 layers: one sliding-window, one full), ChatML template."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from realtime.models.tiny_vlm import CHAT_TEMPLATE, VOCAB_SIZE, build_bpe_tokenizer

    build_bpe_tokenizer(
        out,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        pad_token_id=VOCAB_SIZE - 3,
        bos_token_id=VOCAB_SIZE - 2,
        eos_token_id=VOCAB_SIZE - 1,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(str(out))


@pytest.fixture(scope="module")
async def gemma3_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    from realtime.engine import start_engine
    from tests.conftest import engine_settings

    path = tmp_path_factory.mktemp("tiny-gemma3")
    build_tiny_gemma3(path)
    engine = start_engine(engine_settings(str(path)))
    yield engine
    engine.shutdown()


@pytest.mark.slow
async def test_a_hybrid_attention_model_vllm_serves_is_refused(gemma3_engine: Any) -> None:
    from vllm import SamplingParams
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt

    from realtime.config import ServerConfig
    from realtime.hub import SessionHub
    from retention.records import RETENTION_UNSUPPORTED, SessionReport

    # vLLM serves it: a plain request is answered.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    final = None
    async for out in gemma3_engine.generate(
        TokensPrompt(prompt_token_ids=list(range(100, 140))), params, request_id="plain"
    ):
        final = out
    assert final is not None and len(final.outputs[0].token_ids) == 4

    # The server refuses to start on it, naming the family and the reason.
    with pytest.raises(UncoveredModelFamily) as refused:
        check_model_family(gemma3_engine.model_config)
    message = str(refused.value)
    assert "Gemma3ForCausalLM" in message and "sliding_attention" in message, message
    hub = SessionHub(gemma3_engine, ServerConfig(), model_name="tiny-gemma3")
    with pytest.raises(UncoveredModelFamily, match="Gemma3ForCausalLM"):
        await hub.start()

    # A bounded session opened on the engine directly is ended with the same reason.
    retention = {"streaming_retention": {"sink_chunks": 1, "window_chunks": 2}}
    bounded = SamplingParams(max_tokens=1, extra_args=retention)

    async def chunks() -> AsyncIterator[Any]:
        yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(range(100, 140))))
        await asyncio.sleep(3600)  # the session stays open until the engine ends it

    report = None
    async for out in gemma3_engine.generate(
        chunks(), bounded, request_id=f"bounded-{uuid.uuid4().hex[:8]}"
    ):
        report = SessionReport.from_wire(out.kv_transfer_params) or report
        if out.finished:
            break
    assert report is not None and report.error == RETENTION_UNSUPPORTED, report
    assert report.message is not None and "Gemma3ForCausalLM" in report.message, report
