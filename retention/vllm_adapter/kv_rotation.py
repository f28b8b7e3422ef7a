"""Consolidation by rotation: move cached keys to new RoPE positions in place (vLLM 0.32 CPU).

Why. A consolidation resets a 1D-RoPE session's positions to ``0 .. n - 1`` before the next
chunk would pass the model's trained range. Re-prefilling the window costs a prefill of it on
one frame's path (400-650 ms for ~250 tokens of SmolLM2 on 2 cores, issue #21). But RoPE makes
a cached key ``K = c(p) ⊙ k``: the pre-rotation key ``k`` times, per frequency pair, the complex
number ``c(p) = cos θp + i sin θp`` from the model's own ``cos_sin_cache``. So the key the
token would have at position ``q`` is ``c(q) / c(p) ⊙ K``, computable from the cache alone, for
every layer, with no model step. Attention scores depend on ``q - p`` only, so rotating every
survivor by the same amount changes no logit (the test's oracle); the scheduler renumbers the
survivors exactly as a re-prefill would (``policy.rotation_runs``).

What is checked, and where it refuses (loudly, with :class:`KVRotationError`):

* the rotary embedding: every RoPE module of the model must be a plain ``RotaryEmbedding`` or
  ``Llama3RotaryEmbedding`` (a fixed per-position table) and all must be equal; other kinds
  (dynamic NTK, LongRoPE's two tables, LoRA linear scaling with offsets, mRoPE) are refused.
  The scheduler offers rotation only for these kinds too (``rotation_supported``);
* the key layout: the CPU attention backend stores keys per block and head in an ISA-specific
  order (``vec``: transposed, ``amx``: VNNI pairs). The layout is found by writing small integer
  codes through vLLM's own ``cpu_attn_reshape_and_cache`` into a scratch block and reading where
  they land; a layout that is not a permutation of one block's keys is refused;
* the KV tensors: one block size (the scheduler's), an unquantized dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from retention.vllm_adapter.errors import VLLMAdapterError

ROTATABLE_ROPE_TYPES: Final = frozenset({"default", "llama3"})
"""``rope_type`` values (HF config) whose vLLM module is one of ``_ROTATABLE_CLASSES``."""
_ROTATABLE_CLASSES: Final = ("RotaryEmbedding", "Llama3RotaryEmbedding")
_ROTATOR_ATTR: Final = "_vllm_realtime_kv_rotator"


class KVRotationError(VLLMAdapterError, RuntimeError):
    """The worker cannot rotate this model's cached keys (the scheduler should not have asked)."""


def rope_type_of(hf_text_config: Any) -> str:
    """The config's RoPE kind as vLLM reads it (``rope_parameters`` in transformers 5)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_text_config, name, None)
        if isinstance(params, dict):
            kind = params.get("rope_type") or params.get("type")
            if kind:
                return str(kind)
    return "default"


def rotation_supported(model_config: Any, cache_dtype: str) -> bool:
    """Scheduler side: whether sessions of this engine may consolidate by rotation."""
    if getattr(model_config, "uses_mrope", False) or cache_dtype != "auto":
        return False
    return rope_type_of(model_config.hf_text_config) in ROTATABLE_ROPE_TYPES


@dataclass(frozen=True)
class RopeTable:
    """The model's RoPE: ``cos_sin_cache`` rows are ``[cos θp | sin θp]`` over rotary_dim/2."""

    cos_sin: Any  # float32 [max_position, rotary_dim]
    rotary_dim: int
    neox: bool

    @classmethod
    def of_model(cls, model: Any) -> RopeTable:
        import torch
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

        ropes = [m for m in model.modules() if isinstance(m, RotaryEmbeddingBase)]
        if not ropes:
            raise KVRotationError("the model has no rotary embedding to rotate keys with")
        first = ropes[0]
        for rope in ropes:
            if type(rope).__name__ not in _ROTATABLE_CLASSES:
                raise KVRotationError(
                    f"cannot rotate cached keys of a {type(rope).__name__}: only "
                    f"{', '.join(_ROTATABLE_CLASSES)} have one fixed table per position"
                )
            if (
                rope.rotary_dim != first.rotary_dim
                or rope.is_neox_style != first.is_neox_style
                or not torch.equal(rope.cos_sin_cache, first.cos_sin_cache)
            ):
                raise KVRotationError("the model's layers use different rotary embeddings")
        return cls(
            cos_sin=first.cos_sin_cache.detach().to("cpu", torch.float32),
            rotary_dim=int(first.rotary_dim),
            neox=bool(first.is_neox_style),
        )

    def factors(self, old: Any, new: Any) -> tuple[Any, Any]:
        """Per token and frequency, ``c(new) / c(old)`` as (real, imaginary) float32."""
        half = self.rotary_dim // 2
        co, so = self.cos_sin[old, :half], self.cos_sin[old, half:]
        cn, sn = self.cos_sin[new, :half], self.cos_sin[new, half:]
        norm = co * co + so * so
        return (cn * co + sn * so) / norm, (sn * co - cn * so) / norm

    def pair_dims(self) -> tuple[slice, slice]:
        """The two halves of each rotated pair within a head: (x1, x2)."""
        half = self.rotary_dim // 2
        if self.neox:
            return slice(0, half), slice(half, self.rotary_dim)
        return slice(0, self.rotary_dim, 2), slice(1, self.rotary_dim, 2)


def key_layout(dtype: Any, isa: str, block_size: int, head_size: int) -> Any:
    """Where key element (token t, dim j) of one block and head lies in the block's key region.

    Returns a ``[block_size, head_size]`` int64 tensor of flat offsets into the region
    ``kv[block, head].view(-1)[: block_size * head_size]``, found by writing codes through
    vLLM's own cache write. Codes stay below 128 so that bf16/fp16 hold them exactly."""
    import torch
    from vllm import _custom_ops as ops

    grid_t = torch.arange(block_size).repeat_interleave(head_size).view(block_size, 1, head_size)
    grid_j = torch.arange(head_size).repeat(block_size).view(block_size, 1, head_size)
    decoded = torch.zeros(block_size * head_size, dtype=torch.int64)
    probes = [(grid_t % 128, 1), (grid_t // 128, 128)]
    probes += [(grid_j % 128, 128 * 128), (grid_j // 128, 128 * 128 * 128)]
    for codes, scale in probes:
        kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            (codes + 1).to(dtype),  # +1: an unwritten slot reads 0
            torch.zeros(block_size, 1, head_size, dtype=dtype),
            key_cache,
            value_cache,
            torch.arange(block_size, dtype=torch.int64),
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        region = kv.view(-1)[: block_size * head_size].to(torch.float32)
        if bool((region < 1).any()):
            raise KVRotationError(f"key layout of isa {isa!r} is not a permutation of one block")
        decoded += (region.to(torch.int64) - 1) * scale
    # decoded[offset] = t + 128*128 * j (t < 128*128): invert into layout[t, j] = offset.
    t = decoded % (128 * 128)
    j = decoded // (128 * 128)
    if bool((t >= block_size).any() or (j >= head_size).any()):
        raise KVRotationError(f"key layout of isa {isa!r} is not a permutation of one block")
    layout = torch.full((block_size, head_size), -1, dtype=torch.int64)
    layout[t, j] = torch.arange(block_size * head_size)
    if bool((layout < 0).any()):
        raise KVRotationError(f"key layout of isa {isa!r} is not a permutation of one block")
    return layout


@dataclass(frozen=True)
class KeyCache:
    """One KV tensor and where its keys lie inside a block."""

    tensor: Any  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
    layout: Any  # [block_size, head_size] offsets into a block's key region (`key_layout`)


class KVRotator:
    """Rotates a request's cached keys in every layer of one worker."""

    def __init__(self, table: RopeTable, block_size: int, caches: Sequence[KeyCache]) -> None:
        if not caches:
            raise KVRotationError("no KV cache tensors found to rotate")
        self.table = table
        self.block_size = block_size
        self.caches = list(caches)

    @classmethod
    def of_runner(cls, runner: Any) -> KVRotator:
        """Every distinct KV tensor of the runner's attention layers (as `_zero_block_ids`)."""
        import torch

        block_size = int(runner.cache_config.block_size)
        caches: list[KeyCache] = []
        layouts: dict[tuple[Any, str, int, int], Any] = {}
        seen: set[int] = set()
        context = runner.compilation_config.static_forward_context
        for group in runner.kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                layer = context.get(name)
                kv = getattr(layer, "kv_cache", None)
                if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                    continue
                seen.add(kv.data_ptr())
                if kv.dim() != 4 or kv.shape[2] != block_size:
                    raise KVRotationError(
                        f"layer {name}: KV tensor of shape {tuple(kv.shape)}, expected "
                        f"[blocks, heads, {block_size}, 2 * head_size]"
                    )
                if kv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise KVRotationError(f"layer {name}: cannot rotate a {kv.dtype} KV cache")
                isa = getattr(layer, "isa", None)
                if not isinstance(isa, str):
                    raise KVRotationError(f"layer {name}: no CPU attention ISA set")
                key = (kv.dtype, isa, block_size, kv.shape[3] // 2)
                if key not in layouts:
                    layouts[key] = key_layout(*key)
                caches.append(KeyCache(kv, layouts[key]))
        return cls(RopeTable.of_model(runner.get_model()), block_size, caches)

    def rotate(self, block_ids: Sequence[int], runs: Sequence[tuple[int, int, int]]) -> int:
        """Move the keys of cache indices ``[a, b)`` from position ``i - delta`` to ``i``, for
        every ``(a, b, delta)`` run, in every layer. Returns the tokens rotated."""
        import torch

        if not runs:
            return 0
        index = torch.cat([torch.arange(a, b) for a, b, _ in runs])
        delta = torch.cat([torch.full((b - a,), d, dtype=torch.int64) for a, b, d in runs])
        bs = self.block_size
        if int(index.max()) >= len(block_ids) * bs:
            raise KVRotationError(
                f"rotation up to index {int(index.max())} but the request holds "
                f"{len(block_ids)} blocks of {bs}"
            )
        real, imag = self.table.factors(index - delta, index)
        real, imag = real[:, :, None], imag[:, :, None]  # [tokens, pairs, 1 (heads)]
        blocks = torch.tensor(list(block_ids), dtype=torch.int64)[index // bs][:, None]
        first, second = self.table.pair_dims()
        with torch.no_grad():
            for cache in self.caches:
                kv = cache.tensor
                n_blocks, heads, _, width = kv.shape
                head_size = width // 2
                # [blocks, block's key region, heads]: a view, so indexed writes land in the cache
                region = kv.view(n_blocks, heads, 2 * bs * head_size)[:, :, : bs * head_size]
                region = region.permute(0, 2, 1)
                offsets = cache.layout[index % bs]  # [tokens, head_size]
                at1, at2 = offsets[:, first], offsets[:, second]
                x1 = region[blocks, at1].to(torch.float32)  # [tokens, pairs, heads]
                x2 = region[blocks, at2].to(torch.float32)
                region[blocks, at1] = (x1 * real - x2 * imag).to(kv.dtype)
                region[blocks, at2] = (x2 * real + x1 * imag).to(kv.dtype)
        return int(index.numel())


def rotator_of(runner: Any) -> KVRotator:
    """The runner's rotator, built at its first use (the KV caches exist by then)."""
    rotator: KVRotator | None = getattr(runner, _ROTATOR_ATTR, None)
    if rotator is None:
        rotator = KVRotator.of_runner(runner)
        setattr(runner, _ROTATOR_ATTR, rotator)
    return rotator
