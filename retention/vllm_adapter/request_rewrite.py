"""Rewriting a paused vLLM request's internals for a bounded session (scheduler side).

The fold pipeline (eviction.py) decides; this carries it out on what vLLM keeps of the request:
its per-token arrays (`_all_token_ids`, `prompt_token_ids`, `num_prompt_tokens`,
`num_computed_tokens`, `block_hashes`), its multimodal items and their encoder-cache entries,
and its KV blocks (a range freed in place, or all of them for a re-prefill). Every rewrite also
switches prefix-cache reads off for the request (`capabilities.skip_prefix_cache_reads`): its
hashes no longer describe what a plain prefill of its tokens would cache.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from retention.vllm_adapter.capabilities import skip_prefix_cache_reads
from retention.vllm_adapter.kv_range import evict_token_range_for_request, is_hashed_block


class RequestRewriter:
    """The request surgery of one scheduler's bounded sessions."""

    def __init__(
        self, kv_cache_manager: Any, block_size: int, encoder_cache_manager: Any = None
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.encoder_cache_manager = encoder_cache_manager

    def free_range(self, request: Any, start: int, end: int) -> tuple[int, int, int]:
        """Free the KV of tokens [start, end) in place (kv_range.py): the token range actually
        freed (block-aligned) and the blocks freed."""
        return evict_token_range_for_request(
            self.kv_cache_manager,
            request.request_id,
            start,
            end,
            num_committed_tokens=int(request.num_computed_tokens),
        )

    def compact(self, request: Any, start: int, end: int) -> int:
        width = end - start
        del request._all_token_ids[start:end]
        assert request.prompt_token_ids is not None
        del request.prompt_token_ids[start:end]
        request.num_prompt_tokens = len(request.prompt_token_ids)
        request.num_computed_tokens -= width
        bs = self.block_size
        del request.block_hashes[start // bs : end // bs]
        # Its remaining hashes chain over the uncompacted tokens: never look them up again.
        skip_prefix_cache_reads(request)
        if request.mm_features:
            return self._compact_features(request, start, end)
        return 0

    def _compact_features(self, request: Any, start: int, end: int) -> int:
        """Shift the items after the range; drop those with placeholders in it. Returns the
        encoder-cache entries released."""
        width = end - start
        old = request.mm_features
        new_index: dict[int, int] = {}
        kept: list[Any] = []
        dropped: list[int] = []
        for i, feature in enumerate(old):
            pos = feature.mm_position
            if pos.offset >= end:
                feature.mm_position = replace(pos, offset=pos.offset - width)
            elif pos.offset + pos.length > start:
                # Placeholders (some or all) freed with the range: the item is gone.
                dropped.append(i)
                continue
            new_index[i] = len(kept)
            kept.append(feature)
        if not dropped:
            return 0
        ecm = self.encoder_cache_manager
        if ecm is not None:
            # Encoder inputs this request still references are indexed by position in
            # mm_features: unreference the dropped ones (while the old list is in place) and
            # renumber the others. At a fold every item is computed, so this is normally empty.
            refs = ecm.request_cached_ids.get(request.request_id)
            for i in dropped:
                if refs and i in refs:
                    ecm.free_encoder_input(request, i)
            refs = ecm.request_cached_ids.get(request.request_id)
            if refs:
                ecm.request_cached_ids[request.request_id] = {new_index[i] for i in refs}
        request.mm_features = kept
        if ecm is None:
            return 0
        still_used = {feature.identifier for feature in kept}
        return sum(self._release_encoder_entry(old[i].identifier, still_used) for i in dropped)

    def _release_encoder_entry(self, mm_hash: str, still_used: set[str]) -> bool:
        """Free an unreferenced encoder-cache entry now (vLLM frees them lazily, on pressure)."""
        ecm = self.encoder_cache_manager
        if mm_hash in still_used or ecm.cached.get(mm_hash):
            return False  # this session still holds an identical item, or a request uses it
        num_embeds = ecm.freeable.pop(mm_hash, None)
        if num_embeds is None:
            return False  # already evicted (or never cached)
        ecm.cached.pop(mm_hash, None)
        ecm.num_embeds_by_hash.pop(mm_hash, None)
        ecm.num_free_slots += num_embeds
        ecm.freed.append(mm_hash)  # the worker pops its tensor when the next step reports it
        return True

    def drop_tail(self, request: Any, start: int) -> None:
        """Remove the uncomputed tokens from `start` on (a control chunk's prompt)."""
        del request._all_token_ids[start:]
        assert request.prompt_token_ids is not None
        del request.prompt_token_ids[start:]
        request.num_prompt_tokens = len(request.prompt_token_ids)
        del request.block_hashes[start // self.block_size :]

    def reprefill(self, request: Any) -> None:
        """Self-preemption: free every block, recompute the compacted context from position 0."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.block_hashes.clear()
        request.update_block_hashes()
        # The fresh chain describes the compacted tokens at positions 0..n-1, but reading it
        # could still hit blocks other requests cached for the same tokens: also correct (same
        # tokens, same positions); we skip reads anyway to keep the re-prefill self-contained.
        skip_prefix_cache_reads(request)

    def rehash_for_resume(self, request: Any) -> None:
        """After a preemption (its blocks freed): the hash chain of the compacted tokens, so
        whatever the resume publishes is what a plain prefill of those tokens holds."""
        request.block_hashes.clear()
        request.update_block_hashes()
        skip_prefix_cache_reads(request)

    def may_rotate(self, request: Any, runs: tuple[tuple[int, int, int], ...]) -> bool:
        """Rotating keys rewrites blocks in place: only blocks this request alone holds and no
        prefix-cache entry points to (every block after an evicted range left the index when
        it was evicted; one reached by another request's prefix hit is still shared)."""
        if not runs:
            return True
        bs = self.block_size
        (manager,) = self.kv_cache_manager.coordinator.single_type_managers
        blocks = manager.req_to_blocks[request.request_id]
        for a, b, _ in runs:
            for block in blocks[a // bs : (b - 1) // bs + 1]:
                if block.ref_cnt != 1 or is_hashed_block(manager, block):
                    return False
        return True
