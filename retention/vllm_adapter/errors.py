"""The root of every error the adapter raises, so a caller can catch the adapter's refusals and
failures as one kind. Each subclass keeps the builtin base it had (RuntimeError or ValueError),
so an `except RuntimeError` or `except ValueError` around the adapter still catches it."""

from __future__ import annotations


class VLLMAdapterError(Exception):
    """Raised by retention/vllm_adapter: a refused vLLM, model or configuration, or a failed
    engine-hook invariant."""
