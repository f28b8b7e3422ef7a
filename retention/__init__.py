"""Bounded-session core: retention policy (pure) and the vLLM 0.32 engine hooks that apply it.

`retention.policy` is pure Python (no torch, no vLLM). Everything that touches vLLM internals
lives in `retention.vllm_adapter`, pinned to one vLLM version and checked at start-up.
"""
