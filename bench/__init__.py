"""The benchmarks a maintainer reruns to check a published figure; results go to docs/.

run (the headline: bounded vs unbounded vs stateless), capacity, tail_latency, fidelity,
vlm_fidelity, soak, watch, scale_out_check, report (the shared output), driver (the shared
session driver and frames) and engine_timing (EngineCore-side timers of `run`). One-off
investigations end as a paragraph in docs/benchmarks.md and are deleted (tests/test_layout.py
keeps bench/ to 12 modules, functions to 80 lines, and free of `tests` imports).
"""
