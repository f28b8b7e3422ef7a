"""Fixtures shared by the retention tests: the transformers oracles' models and processors.

Module-scoped, so each test module loads its own. `hf_model`/`tokenizer` are SmolLM2-135M's
(the text oracles, text_oracle.py); `hf_vlm`/`processor` are the tiny random Qwen2-VL's (the
video oracles, vlm_oracle.py). A module testing another model defines its own of the same name,
which pytest prefers over these (test_mrope_families.py, test_smolvlm_retention.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from realtime.models import model_dir


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


@pytest.fixture(scope="module")
def hf_vlm() -> Any:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(
        str(model_dir("tiny-qwen2-vl")), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def processor() -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir("tiny-qwen2-vl")))


ROOT = Path(__file__).resolve().parents[2]


def run_probe(
    module: str, *argv: str, env: Mapping[str, str | None], timeout: float
) -> dict[str, Any]:
    """Run `python -m tests.retention.<module> argv...` in a fresh process from the root, with
    `env` over this process's environment (None: unset); the JSON of its last `PROBE ` line.
    A fresh process: vLLM settles its plugins and the model runner once per process."""
    environ = dict(os.environ)
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    done = subprocess.run(
        [sys.executable, "-m", f"tests.retention.{module}", *argv],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(lines[-1].removeprefix("PROBE "))
    return report
