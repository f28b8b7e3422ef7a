"""A chunk's prompt rendered by vLLM's own renderer before it is streamed, as vLLM asks callers.

`AsyncLLM` still takes raw prompts (the dicts our sessions build: text or token ids, with
`multi_modal_data`) and renders each one itself inside its input loop, with the deprecation
warning "Passing raw prompts to InputProcessor is deprecated". `render_prompt` runs the same
steps that `InputProcessor.process_inputs` runs on a raw prompt (`parse_model_prompt`, then
`Renderer.render_cmpl` with the default tokenization parameters), through the renderer's async
variant: images are processed on the renderer's own thread instead of on the event loop that
streams every other session's tokens. The processor cache is off in serve (engine.py), so a
chunk rendered and then dropped (its session closed first) leaves no cache entry behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_rendered(prompt: Mapping[str, Any]) -> bool:
    """Whether vLLM takes `prompt` as rendered: `process_inputs` reads a "type" key as that."""
    return "type" in prompt


async def render_prompt(engine: Any, prompt: Mapping[str, Any]) -> Mapping[str, Any]:
    """`prompt` (a raw prompt dict) as `engine`'s renderer makes it for `process_inputs`."""
    if is_rendered(prompt):
        return prompt
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    renderer = engine.renderer
    parsed = parse_model_prompt(engine.model_config, dict(prompt))
    (rendered,) = await renderer.render_cmpl_async([parsed], renderer.default_cmpl_tok_params)
    return rendered  # type: ignore[no-any-return]
