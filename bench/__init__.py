"""Benchmarks of vllm-realtime sessions; `python -m bench.run --help`. Results go to docs/."""
