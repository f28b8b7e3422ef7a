"""The oracle of a bounded session, and the comparison with it: no vLLM.

What in-place eviction computes is a dense forward pass over every token the session ever
received, at its original position, under an attention mask that lets each token see exactly
what the cache held when it was computed (the survivors, and the earlier tokens of its own
chunk): a surviving token's cached K/V was computed while the now-evicted tokens were still
there. After a consolidation, or the resume of a preempted session, the survivors sit at
0..n-1: a fresh prefill of them. `realtime/selfcheck.py` runs these checks against a live
engine; the retention tests use the same oracle.

The model is a transformers causal LM on CPU (float32 for the tolerances here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TEXT_TOLERANCE = 2e-3
"""|Δ log-prob| allowed between vLLM and the dense oracle on a 1D text model, float32. vLLM's
kernels and transformers' eager attention differ in summation order only (measured ~1e-5);
a wrong position or a stale KV block moves log-probs by > 0.1."""


def dense_logprobs(model: Any, token_ids: Sequence[int], positions: Sequence[int]) -> Any:
    """Next-token log-probabilities after a causal forward over `token_ids` at `positions`."""
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([list(token_ids)]),
            position_ids=torch.tensor([list(positions)]),
        )
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def masked_logprobs(model: Any, tokens: Sequence[int], visible: Sequence[Sequence[int]]) -> Any:
    """Dense forward over all tokens at positions 0..n-1; token j attends to `visible[j]`."""
    import torch

    n = len(tokens)
    mask = torch.full((1, 1, n, n), float("-inf"))
    for j, seen in enumerate(visible):
        mask[0, 0, j, list(seen)] = 0.0
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([list(tokens)]),
            position_ids=torch.arange(n)[None],
            attention_mask=mask,
        )
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def causal_visibility(count: int, start: int = 0) -> list[list[int]]:
    """What each of `count` tokens at start.. sees in a plain prefill from `start`."""
    return [list(range(start, start + j + 1)) for j in range(count)]


def chunk_visibility(held: Sequence[int], cursor: int, count: int) -> list[list[int]]:
    """What each token of a chunk appended at position `cursor` sees: the positions the cache
    holds (`held`) and the chunk's own earlier tokens."""
    return [list(held) + list(range(cursor, cursor + j + 1)) for j in range(count)]


@dataclass(frozen=True)
class Comparison:
    """vLLM's top log-probs against an oracle's full distribution."""

    worst_delta: float
    same_argmax: bool

    def within(self, tolerance: float) -> bool:
        return self.worst_delta < tolerance and self.same_argmax


def compare_logprobs(got: Mapping[int, float], want: Any) -> Comparison:
    """`got`: vLLM's top-k log-probs (token id -> log-prob) at one step; `want`: the oracle's
    log-probs over the vocabulary (a tensor). The argmax is compared as well."""
    if not got:
        return Comparison(float("inf"), False)
    worst = max(abs(lp - float(want[tok])) for tok, lp in got.items())
    return Comparison(worst, max(got, key=got.__getitem__) == int(want.argmax()))
