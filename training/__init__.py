"""How the shipped `smol-qwen2-vl` weights were made: frame synthesis, code tuning, tower training.

Not part of the server: not in the wheel (pyproject's `packages.find` lists only `protocol`,
`retention` and `realtime`), and nothing under `realtime/` imports it (tests/test_layout.py).
Dependencies run one way: `vision_train` -> `vision_codes` -> `synth_frames` -> `realtime.models`.
"""
