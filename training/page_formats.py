"""The demo page's constrained replies: what each default model was tuned to say.

With `smol-qwen2-vl` the page asks every frame through the session's `response_format`, limited
to the descriptions the model was tuned on ("A yellow circle on a green background."), as
`bench/vlm_fidelity.py --reply-format describe` does. In free text the 135M language model can
drift into copying an earlier reply ("One red circle." for a green frame, issue #40); a
constrained reply keeps its form, so only the words it picks from the frame can be wrong.

The page reads the result from `realtime/static/tuned-replies.json` (a model name -> its
response_format); `make types` rewrites it, and tests/clients/test_types_drift.py checks it.

    python -m training.page_formats > realtime/static/tuned-replies.json
"""

from __future__ import annotations

import json
from typing import Any

from training.vision_codes import all_specs, answer


def describe_format() -> dict[str, Any]:
    """OpenAI's response_format: one JSON string, one of smol-qwen2-vl's tuned descriptions."""
    sentences = sorted({answer("describe", s) for s in all_specs()})
    return {
        "type": "json_schema",
        "json_schema": {"name": "tuned_describe", "schema": {"type": "string", "enum": sentences}},
    }


def page_formats() -> dict[str, dict[str, Any]]:
    """Model name -> the response_format the page sends by default with that model."""
    return {"smol-qwen2-vl": describe_format()}


def render() -> str:
    return json.dumps(page_formats(), indent=1) + "\n"


if __name__ == "__main__":
    print(render(), end="")
