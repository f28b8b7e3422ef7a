"""The session store against a real redis-server (no engine): claims, fencing, expiry, and
that every refusal is the same `None` (the server's `session_not_found`)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.exceptions import TimeoutError as RedisTimeout

from realtime.session_store import (
    OUTAGE_CALL_TIMEOUT_S,
    SessionStore,
    StoredSession,
    digest,
    held_media,
)
from retention.records import SessionSnapshot
from vllm_realtime_protocol import SessionConfig

GRACE = 30.0


def stored(frames: int = 2) -> StoredSession:
    snap = SessionSnapshot(
        token_ids=[1, 2, 3, 4, 5],
        segments=[(0, "chunk", 3, True, False), (1, "chunk", 2, False, False)],
        next_index=2,
        chunks=2,
    )
    return StoredSession(SessionConfig(modality="text"), frames, {"completed": 2}, True, 2, snap)


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[tuple[SessionStore, SessionStore]]:
    a = SessionStore.connect(redis_url, "replica-a")
    b = SessionStore.connect(redis_url, "replica-b")
    await a.redis.flushdb()
    yield a, b
    await a.close()
    await b.close()


async def test_record_round_trips(stores: tuple[SessionStore, SessionStore]) -> None:
    a, b = stores
    await a.create("s1", "key-a", "tok-1", GRACE, stored())
    claim = await b.claim("s1", "tok-1", "key-a", "tok-2", GRACE)
    assert claim is not None and claim.fence == 2  # created with 1; each claim adds one
    assert claim.stored == stored()
    # Neither the API key nor the token is in the store, only their digests.
    values = await a.redis.hgetall(a.key("s1"))
    assert "key-a" not in values.values() and "tok-2" not in values.values()


async def test_refusals_are_all_alike(stores: tuple[SessionStore, SessionStore]) -> None:
    a, b = stores
    await a.create("s1", "key-a", "tok-1", GRACE, stored())
    assert await b.claim("s1", "tok-1", "key-b", "x", GRACE) is None  # another API key
    assert await b.claim("s1", "wrong", "key-a", "x", GRACE) is None  # wrong token
    assert await b.claim("nope", "tok-1", "key-a", "x", GRACE) is None  # unknown id
    assert await b.claim("s1", "tok-1", None, "x", GRACE) is None  # no key at all
    assert await b.claim("s1", "tok-1", "key-a", "tok-2", GRACE) is not None
    # The token worked once: replaying it is refused, the rotated one works.
    assert await a.claim("s1", "tok-1", "key-a", "tok-3", GRACE) is None
    assert await a.claim("s1", "tok-2", "key-a", "tok-3", GRACE) is not None


async def test_a_lost_lease_writes_nothing(stores: tuple[SessionStore, SessionStore]) -> None:
    a, b = stores
    fence_a = await a.create("s1", "key-a", "tok-1", GRACE, stored(2))
    claim = await b.claim("s1", "tok-1", "key-a", "tok-2", GRACE)
    assert claim is not None
    # The old owner still thinks it holds the session: every fenced call is refused.
    assert not await a.write("s1", fence_a, stored(9), GRACE)
    assert not await a.refresh("s1", fence_a, GRACE)
    assert not await a.delete("s1", fence_a)
    assert await b.write("s1", claim.fence, stored(3), GRACE)
    again = await b.claim("s1", "tok-2", "key-a", "tok-3", GRACE)
    assert again is not None and again.stored.frames_total == 3  # the new owner's write only


async def test_close_and_expiry_leave_nothing(stores: tuple[SessionStore, SessionStore]) -> None:
    a, _ = stores
    fence = await a.create("s1", "key-a", "tok-1", GRACE, stored())
    assert await a.delete("s1", fence)
    await a.create("s2", "key-a", "tok-1", 0.3, stored())
    assert await a.redis.exists(a.key("s2"))
    await asyncio.sleep(0.5)
    assert await a.redis.keys("*") == []  # the grace period removed s2; s1 was deleted
    assert await a.claim("s2", "tok-1", "key-a", "x", GRACE) is None


async def test_give_back_restores_the_presented_token(
    stores: tuple[SessionStore, SessionStore],
) -> None:
    a, b = stores
    await a.create("s1", "key-a", "tok-1", GRACE, stored())
    claim = await b.claim("s1", "tok-1", "key-a", "tok-2", GRACE)
    assert claim is not None
    assert await b.give_back("s1", claim.fence, "tok-1", GRACE)
    assert await a.claim("s1", "tok-1", "key-a", "tok-3", GRACE) is not None


def video_state(media: dict[int, str], frames_total: int = 3) -> StoredSession:
    snap = SessionSnapshot(
        token_ids=[1, 2, 3, 4, 5],
        segments=[(0, "chunk", 3, True, False), (2, "chunk", 2, False, False)],
        next_index=3,
        chunks=3,
    )
    return StoredSession(
        SessionConfig(modality="video"),
        frames_total,
        {"completed": frames_total},
        True,
        frames_total,
        snap,
        media,  # type: ignore[arg-type]  # literal kinds
    )


async def test_frames_live_and_die_with_the_record(
    stores: tuple[SessionStore, SessionStore],
) -> None:
    """A video session's frames: written with the fold that retains them, deleted with the
    fold that evicts them, fenced like the state, handed to the claimer, and gone with the
    session (close, expiry)."""
    a, b = stores
    jpeg0, jpeg1, jpeg2 = b"\xff\xd8zero\x00", b"\xff\xd8one\xff", b"\xff\xd8two"
    fence = await a.create("s1", "key-a", "tok-1", GRACE, video_state({}, 0))
    assert await a.write("s1", fence, video_state({0: "image"}, 1), GRACE, frames={0: jpeg0})
    assert await a.write(
        "s1", fence, video_state({0: "image", 1: "image"}, 2), GRACE, frames={1: jpeg1}
    )
    # The third fold evicts segment 1: its frame is deleted in the same write.
    state = video_state({0: "image", 2: "video"}, 3)
    assert await a.write("s1", fence, state, GRACE, frames={2: jpeg2}, drop_frames=[1])
    fields = await a.redis.hkeys(a.key("s1"))
    assert sorted(f for f in fields if f.startswith("frame:")) == ["frame:0", "frame:2"]
    claim = await b.claim("s1", "tok-1", "key-a", "tok-2", GRACE)
    assert claim is not None
    assert claim.frames == {0: jpeg0, 2: jpeg2}  # bytes exactly as written
    assert claim.stored.media == {0: "image", 2: "video"}
    # The old owner's fence is refused: no frame of its lands after the claim.
    assert not await a.write("s1", fence, state, GRACE, frames={5: b"late"})
    assert "frame:5" not in await a.redis.hkeys(a.key("s1"))
    assert await b.delete("s1", claim.fence)
    assert await a.redis.keys("*") == []
    # Expiry removes the frames with the rest.
    fence = await a.create("s2", "key-a", "tok-1", 0.3, video_state({}, 0))
    assert await a.write("s2", fence, video_state({0: "image"}, 1), 0.3, frames={0: jpeg0})
    await asyncio.sleep(0.5)
    assert await a.redis.keys("*") == []


def test_held_media_follows_the_window() -> None:
    def snap(segments: list[tuple[int, str, int, bool, bool]], next_index: int) -> SessionSnapshot:
        n = sum(s[2] for s in segments)
        return SessionSnapshot(list(range(n)), segments, next_index, next_index)

    # No text window: one "chunk" segment per chunk. Chunk 0 (instructions) is text.
    s1 = snap([(0, "chunk", 4, False, False)], 1)
    assert held_media({}, s1, 0, None) == ({}, None)
    s2 = snap([(0, "chunk", 4, False, False), (1, "chunk", 3, False, False)], 2)
    assert held_media({}, s2, 1, "image") == ({1: "image"}, 1)
    # Chunk 2's fold evicts chunk 1 whole: its frame goes, chunk 2's comes.
    s3 = snap([(0, "chunk", 4, False, False), (2, "chunk", 3, False, False)], 3)
    assert held_media({1: "image"}, s3, 2, "video") == ({2: "video"}, 2)
    # A remnant (a chunk cut by block-aligned eviction) keeps no frame.
    s4 = snap([(0, "chunk", 4, False, False), (2, "chunk", 1, False, True)], 3)
    assert held_media({2: "video"}, s4, 3, None) == ({}, None)
    # Text window: the frame is the "frame" segment, not the reply segments around it.
    s5 = snap(
        [(0, "text", 4, True, False), (1, "frame", 3, False, False), (2, "reply", 2, False, False)],
        3,
    )
    assert held_media({}, s5, 1, "image") == ({1: "image"}, 1)


async def test_only_a_restart_that_lost_the_hash_lets_its_owner_write_it_again(
    stores: tuple[SessionStore, SessionStore],
) -> None:
    """`lost` is true only for a new Redis run without the hash (a close or a claim elsewhere,
    under the same run, never qualifies); `recreate` writes only where the hash is missing,
    with the owner's fence and current token, so a resume works from it."""
    a, b = stores
    run = await a.run_id()
    fence = await a.create("s1", "key-a", "tok-1", GRACE, stored())
    assert not await a.lost("s1", run)  # there
    await a.redis.delete(a.key("s1"))
    assert not await a.lost("s1", run)  # gone under the same run: closed or expired
    assert await a.lost("s1", "an-earlier-run")  # gone with a restart
    assert await a.recreate("s1", "key-a", digest("tok-1"), fence, GRACE, stored(4), {1: b"jp"})
    assert not await a.recreate("s1", "key-a", digest("tok-1"), fence, GRACE, stored(5), {})
    assert await a.write("s1", fence, stored(6), GRACE)  # the owner's fence holds again
    claim = await b.claim("s1", "tok-1", "key-a", "tok-2", GRACE)
    assert claim is not None and claim.stored.frames_total == 6 and claim.frames == {1: b"jp"}
    assert not await a.write("s1", fence, stored(7), GRACE)  # claimed: the fence moved on
    assert not await a.lost("s1", run)


async def test_a_redis_that_hangs_costs_a_turn_one_timeout_then_half_a_second(
    stores: tuple[SessionStore, SessionStore], redis_server: tuple[Any, str]
) -> None:
    """A redis-server stopped with SIGSTOP answers nothing (connections still open): the first
    call waits the socket timeout (3 s); then the calls on a turn's path give up after
    OUTAGE_CALL_TIMEOUT_S, while the keeper's probe waits the whole timeout; the first call that
    succeeds again ends the outage."""
    a, _ = stores
    proc = redis_server[0]
    await a.create("s1", "key-a", "tok-1", GRACE, stored())
    proc.send_signal(signal.SIGSTOP)
    try:
        took = []
        for call in (
            lambda: a.refresh("s1", 1, GRACE),  # the check before a turn
            lambda: a.write("s1", 1, stored(3), GRACE),  # the write after it
            lambda: a.refresh("s1", 1, GRACE, probe=True),  # the keeper's
        ):
            started = time.monotonic()
            with pytest.raises((TimeoutError, RedisTimeout)):
                await call()
            took.append(time.monotonic() - started)
            assert a.failing
    finally:
        proc.send_signal(signal.SIGCONT)
    assert 2.5 < took[0] < 4.5 and took[1] < OUTAGE_CALL_TIMEOUT_S + 0.5, took
    assert took[2] > 2.5, took
    assert await a.refresh("s1", 1, GRACE, probe=True) and not a.failing
    assert await a.write("s1", 1, stored(3), GRACE)
