"""Consolidation by rotation, worker side: the key layout probe and the rotation itself, against
vLLM's own cache write and rotary embedding (no engine). Oracle: a key computed at position p,
written to the cache and rotated to q equals the key computed at q."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from retention.vllm_adapter.kv_rotation import (  # noqa: E402
    KeyCache,
    KVRotationError,
    KVRotator,
    RopeTable,
    key_layout,
    rope_type_of,
)

HEADS, HEAD, BLOCK, BLOCKS = 3, 64, 32, 6


def _rope(dtype: torch.dtype, neox: bool, rope_type: str = "default") -> torch.nn.Module:
    params: dict[str, object] = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "llama3":
        params.update(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=1024,
        )
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            HEAD, max_position=4096, is_neox_style=neox, rope_parameters=params, dtype=dtype
        )
    return torch.nn.ModuleList([rope])


def _write(kv: torch.Tensor, key: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    key_cache, value_cache = kv.view(BLOCKS, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key.contiguous(),
        torch.zeros_like(key),
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )


def _read(kv: torch.Tensor, layout: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    region = kv.view(BLOCKS, HEADS, -1)[:, :, : BLOCK * HEAD].permute(0, 2, 1)
    return region[(slots // BLOCK)[:, None], layout[slots % BLOCK]].permute(0, 2, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_key_layout_probe_finds_where_the_cache_write_puts_each_key(dtype: torch.dtype) -> None:
    isa = _get_attn_isa(dtype, BLOCK, HEAD)
    layout = key_layout(dtype, isa, BLOCK, HEAD)
    assert sorted(layout.view(-1).tolist()) == list(range(BLOCK * HEAD))
    kv = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    slots = torch.randperm(BLOCKS * BLOCK)[:70]
    key = torch.randn(70, HEADS, HEAD).to(dtype)
    _write(kv, key, slots, isa)
    assert torch.equal(_read(kv, layout, slots), key)


@pytest.mark.parametrize(
    ("dtype", "neox", "rope_type"),
    [
        (torch.float32, True, "default"),
        (torch.float32, False, "default"),
        (torch.float32, True, "llama3"),
        (torch.bfloat16, True, "default"),
    ],
)
def test_a_rotated_key_equals_the_key_computed_at_its_new_position(
    dtype: torch.dtype, neox: bool, rope_type: str
) -> None:
    model = _rope(dtype, neox, rope_type)
    rope = model[0]
    isa = _get_attn_isa(dtype, BLOCK, HEAD)
    kv = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    rotator = KVRotator(
        RopeTable.of_model(model), BLOCK, [KeyCache(kv, key_layout(dtype, isa, BLOCK, HEAD))]
    )
    # A compacted table: cache index i lives in block_ids[i // BLOCK].
    block_ids = [4, 1, 5, 0]
    # (start, end, delta): tokens at cache index i sat at position i - delta (gaps, as after
    # evictions; a negative delta moves a token up).
    runs = [(10, 40, -700), (40, 45, -3), (60, 100, -1500), (100, 101, 50)]
    n = 101
    new = torch.arange(n)
    old = new.clone()
    for a, b, d in runs:
        old[a:b] -= d
    raw = torch.randn(n, HEADS * HEAD).to(dtype)
    _, at_old = rope.forward_native(old, torch.zeros_like(raw), raw.clone())
    _, at_new = rope.forward_native(new, torch.zeros_like(raw), raw.clone())
    slots = torch.tensor([block_ids[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)])
    _write(kv, at_old.view(n, HEADS, HEAD), slots, isa)
    untouched = kv.clone()
    assert rotator.rotate(block_ids, runs) == sum(b - a for a, b, _ in runs)
    got = _read(kv, rotator.caches[0].layout, slots).to(torch.float32)
    want = at_new.view(n, HEADS, HEAD).to(torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol)
    # Only the keys of the runs changed: tokens outside them and every value are as written.
    outside = torch.tensor([i for i in range(n) if not any(a <= i < b for a, b, _ in runs)])
    assert torch.equal(
        _read(kv, rotator.caches[0].layout, slots[outside]),
        _read(untouched, rotator.caches[0].layout, slots[outside]),
    )
    values = lambda t: t.view(BLOCKS, HEADS, -1)[:, :, BLOCK * HEAD :]  # noqa: E731
    assert torch.equal(values(kv), values(untouched))


def test_rotation_refuses_an_index_past_the_request_blocks() -> None:
    model = _rope(torch.float32, True)
    kv = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD)
    isa = _get_attn_isa(torch.float32, BLOCK, HEAD)
    rotator = KVRotator(
        RopeTable.of_model(model),
        BLOCK,
        [KeyCache(kv, key_layout(torch.float32, isa, BLOCK, HEAD))],
    )
    with pytest.raises(KVRotationError, match="holds 1 blocks"):
        rotator.rotate([2], [(0, BLOCK + 1, 5)])


def test_only_ropes_with_one_table_per_position_are_rotated() -> None:
    with set_current_vllm_config(VllmConfig()):
        ntk = get_rope(
            HEAD,
            max_position=4096,
            is_neox_style=True,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            dtype=torch.float32,
        )
    with pytest.raises(KVRotationError, match="cannot rotate"):
        RopeTable.of_model(torch.nn.ModuleList([ntk]))
    with pytest.raises(KVRotationError, match="no rotary"):
        RopeTable.of_model(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))


def test_rope_type_is_read_from_either_config_field() -> None:
    from types import SimpleNamespace

    assert rope_type_of(SimpleNamespace(rope_parameters={"rope_type": "yarn"})) == "yarn"
    assert rope_type_of(SimpleNamespace(rope_scaling={"type": "llama3"})) == "llama3"
    assert rope_type_of(object()) == "default"
