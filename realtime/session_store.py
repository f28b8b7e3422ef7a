"""The shared session store (issue #39): resumable sessions that outlive their replica.

Theory of operation: a bounded session's state is small and bounded (its sinks and its window),
so every replica writes what rebuilds each of its resumable sessions to one Redis, at every
fold, and any replica can take a session over: it claims it in the store, re-prefills the
retained tokens once (`EngineSession.restore`) and answers `session.resumed`.

One Redis hash per session, `vrt:session:<id>`, expiring `grace_s` after its owner last
refreshed it (the owner refreshes it while it holds the session, attached or parked; a dead
owner stops, and the hash is gone one grace period later):

* `owner`: SHA-256 of the API key that opened it; `token`: SHA-256 of the current resume token.
  Neither secret is stored. A claim presents both digests; any mismatch, like a missing hash,
  is the same `None` (the caller answers `session_not_found`).
* `fence`: the fencing token, incremented by every claim. The owner writes, refreshes and
  deletes only with the fence it holds (each a Lua script, atomic in Redis); a replica whose
  session was claimed by another sees its fence refused and lets the session go, so a lost
  lease never makes a second writer.
* `lease`: the replica that holds the session (for the logs and the router).
* `state`: the session's rebuild record (`StoredSession`: config, counters, the engine's
  `SessionSnapshot`, which retained segment holds which kind of frame), JSON. Its size is
  bounded by the window: the retained token ids.
* `frame:<segment>` (video sessions): the bytes the client sent for the frame or clip of that
  retained history segment (base64: the client decodes replies as text), one field per sink or
  window chunk. A fold writes its new frame and deletes the fields of the chunks its eviction
  drops, in the same fenced script as `state`; the fields live and die with the hash (its TTL,
  close, expiry), so no frame outlives the grace period.

A claim rotates the token digest in the same script, so a token works once (a replayed one is
refused). Close and expiry delete the hash (fenced), and Redis' TTL removes what a dead replica
left: nothing of a session outlives its grace period.

When the store stops answering, the owner keeps serving its sessions; their writes fail and are
retried (the keeper rewrites the last fold once Redis answers again). Once a call failed, the
calls a turn waits for (the check before it, the write after it) wait at most
`OUTAGE_CALL_TIMEOUT_S` until a call succeeds again: a Redis that hangs instead of refusing
would otherwise cost every turn two socket timeouts. The keeper's refresh (`probe`) waits the
whole socket timeout, so a slow Redis still ends the outage. A store that restarted
without the hash (a new `run_id`, no persistence, or the TTL passed while it was down) gets the
whole record again from its owner (`lost`, `recreate`): only a restart can make a held hash
vanish without a claim, so no second writer comes of it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlparse

from retention.records import SessionSnapshot
from vllm_realtime_protocol import SessionConfig

log = logging.getLogger("vllm_realtime")

T = TypeVar("T")

OUTAGE_CALL_TIMEOUT_S = 0.5
"""While the store is failing, how long a call on a turn's path waits (module docstring)."""
_PREFIX = "vrt:session:"
_FRAME = "frame:"

MediaKind = Literal["image", "video"]

# KEYS[1] the session; ARGV: token digest, owner digest, new token digest, replica, ttl (ms).
_CLAIM = """
local h = redis.call('HMGET', KEYS[1], 'token', 'owner', 'state')
if not h[1] or h[1] ~= ARGV[1] or h[2] ~= ARGV[2] then return false end
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('HSET', KEYS[1], 'token', ARGV[3], 'lease', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
local out = {fence, h[3]}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 6) == 'frame:' then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
"""

# ARGV: fence, ttl (ms), then field/value pairs to set. 1: done; 0: the fence moved on.
_FENCED_SET = """
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then return 0 end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# ARGV: fence, ttl (ms), n, then n fields to delete, then field/value pairs to set (a fold:
# its state and new frame, and the frames its eviction dropped). 1: done; 0: the fence moved on.
_FENCED_WRITE = """
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[3])
for i = 4, 3 + n do redis.call('HDEL', KEYS[1], ARGV[i]) end
for i = 4 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# ARGV: ttl (ms), then field/value pairs: the whole hash, written only where it is missing.
_RECREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

_FENCED_DELETE = """
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


def digest(secret: str | None) -> str:
    """What the store keeps of a secret (an API key, a resume token): its SHA-256."""
    raw = b"\x00anonymous" if secret is None else secret.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class StoredSession:
    """What rebuilds one session on another replica (the `state` field of its hash)."""

    config: SessionConfig
    frames_total: int
    """Chunks accepted and answered when this was written: the next frame_index."""
    responses: dict[str, int]
    """Finished replies by status (the state machine's counters)."""
    turn_open: bool
    """The last chunk was answered: the next chunk closes its assistant turn first."""
    chunks: int
    """Chunks the engine session ran (the first one carries the instructions)."""
    snapshot: SessionSnapshot | None
    """The engine's held tokens and history at the last fold (None before the first)."""
    media: dict[int, MediaKind] = field(default_factory=dict)
    """Video sessions: the kind of frame each retained (whole) chunk segment holds, by segment
    index; its bytes are the hash's `frame:<index>` field."""

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "config": self.config.model_dump(mode="json", by_alias=True),
            "frames_total": self.frames_total,
            "responses": self.responses,
            "turn_open": self.turn_open,
            "chunks": self.chunks,
            "snapshot": None if self.snapshot is None else self.snapshot.to_dict(),
            "media": sorted(self.media.items()),
        }
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> StoredSession:
        body = json.loads(raw)
        snap = body.get("snapshot")
        return cls(
            config=SessionConfig.model_validate(body["config"]),
            frames_total=int(body["frames_total"]),
            responses={str(k): int(v) for k, v in body["responses"].items()},
            turn_open=bool(body["turn_open"]),
            chunks=int(body["chunks"]),
            snapshot=None if snap is None else SessionSnapshot.from_dict(snap),
            media={int(i): _media_kind(k) for i, k in body.get("media", [])},
        )


def _media_kind(kind: str) -> MediaKind:
    if kind not in ("image", "video"):
        raise ValueError(f"stored frame of unknown kind {kind!r}")
    return "image" if kind == "image" else "video"


def held_media(
    held: Mapping[int, MediaKind],
    snapshot: SessionSnapshot | None,
    first_new: int,
    kind: MediaKind | None,
) -> tuple[dict[int, MediaKind], int | None]:
    """Which retained segments hold a frame after a chunk boundary, and which segment the
    chunk just answered became (None: it holds no frame, or it is not retained).

    `held`: the frames stored before; `first_new`: the snapshot's `next_index` before this
    chunk (its segments are numbered from there); `kind`: the chunk's frame kind, None for a
    text chunk or a control chunk. A frame is kept only while its chunk's segment is whole: a
    remnant (a chunk cut by block-aligned eviction) lost its frame in the engine too, and a
    rebuild drops remnants, as an mRoPE consolidation does."""
    if snapshot is None:
        return {}, None
    whole = {seg[0] for seg in snapshot.segments if not seg[4]}
    media = {i: k for i, k in held.items() if i in whole}
    new_index = None
    if kind is not None:
        # One "frame" segment (text window) or one "chunk" segment (chunk and reply) per chunk.
        fresh = [
            seg[0]
            for seg in snapshot.segments
            if seg[0] >= first_new and seg[1] in ("frame", "chunk") and not seg[4]
        ]
        if fresh:
            new_index = fresh[0]
            media[new_index] = kind
    return media, new_index


@dataclass(frozen=True)
class Claim:
    """A successful claim: the fence this replica now holds, and the session's record."""

    fence: int
    stored: StoredSession
    frames: dict[int, bytes] = field(default_factory=dict)
    """The stored frames' bytes by segment index (video sessions)."""


class SessionStore:
    """The Redis session store of one replica (`serve --session-store redis://HOST:PORT/DB`)."""

    def __init__(self, client: Any, replica: str) -> None:
        self.redis = client
        self.replica = replica
        self._claim = client.register_script(_CLAIM)
        self._set = client.register_script(_FENCED_SET)
        self._delete = client.register_script(_FENCED_DELETE)
        self._write = client.register_script(_FENCED_WRITE)
        self._recreate = client.register_script(_RECREATE)
        self.bytes_written_last = 0
        # The last call failed (refused, or timed out): Redis is down or does not answer.
        self.failing = False

    async def _call(self, call: Awaitable[T], *, probe: bool = False) -> T:
        """One call to Redis, noting whether the store is failing (the module docstring)."""
        try:
            if self.failing and not probe:
                result = await asyncio.wait_for(call, OUTAGE_CALL_TIMEOUT_S)
            else:
                result = await call
        except Exception:
            self.failing = True
            raise
        self.failing = False
        return result

    @classmethod
    def connect(cls, url: str, replica: str) -> SessionStore:
        """A store on `url` (redis://HOST:PORT/DB; the connection opens at first use)."""
        import redis.asyncio as aioredis

        if urlparse(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"--session-store needs a redis:// URL, got {url.split('://')[0]!r}")
        # Timeouts: a Redis that stops answering (not only one that refuses connections) must
        # not hold a turn up; the session goes on and the write is retried.
        client = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=3.0, socket_connect_timeout=2.0
        )
        return cls(client, replica)

    async def ping(self) -> None:
        await self.redis.ping()

    async def close(self) -> None:
        await self.redis.aclose()

    async def run_id(self) -> str:
        """The Redis server's run id: a new one after each restart (which may have lost data)."""
        info = await self._call(self.redis.info("server"))
        return str(info.get("run_id", ""))

    async def lost(self, session_id: str, run_id: str | None) -> bool:
        """Whether a held session's hash is gone because the store restarted without it (a
        new run id, and no hash). Not when it was deleted or expired under the same run
        (closed, or claimed elsewhere and closed there): only a lost one may be `recreate`d."""
        if run_id is None or await self.run_id() == run_id:
            return False
        return not await self._call(self.redis.exists(self.key(session_id)))

    async def recreate(
        self,
        session_id: str,
        owner: str | None,
        token_digest: str,
        fence: int,
        grace_s: float,
        state: StoredSession,
        frames: Mapping[int, bytes],
    ) -> bool:
        """Write a held session's whole record again after the store lost it (`lost`): the
        owner's digests and fence, its last fold's state and every retained frame; only where
        the hash is still missing. False: it exists (someone wrote it meanwhile)."""
        pairs: list[str] = [
            "owner",
            digest(owner),
            "token",
            token_digest,
            "fence",
            str(fence),
            "lease",
            self.replica,
            "state",
            state.to_json(),
        ]
        for index, data in frames.items():
            pairs += [_FRAME + str(index), base64.b64encode(data).decode("ascii")]
        ok = await self._call(
            self._recreate(keys=[self.key(session_id)], args=[_ms(grace_s), *pairs])
        )
        return bool(ok)

    @staticmethod
    def key(session_id: str) -> str:
        return _PREFIX + session_id

    async def create(
        self, session_id: str, owner: str | None, token: str, grace_s: float, state: StoredSession
    ) -> int:
        """Register a new resumable session held by this replica; its fence (1)."""
        key = self.key(session_id)
        mapping = {
            "owner": digest(owner),
            "token": digest(token),
            "fence": 1,
            "lease": self.replica,
            "state": state.to_json(),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, _ms(grace_s))
            await self._call(pipe.execute())
        return 1

    async def claim(
        self, session_id: str, token: str, owner: str | None, new_token: str, grace_s: float
    ) -> Claim | None:
        """Take the session over if `token` and `owner` match (rotating the token to
        `new_token`); None for every refusal alike."""
        got = await self._call(
            self._claim(
                keys=[self.key(session_id)],
                args=[digest(token), digest(owner), digest(new_token), self.replica, _ms(grace_s)],
            )
        )
        if not got:
            return None
        fence, raw, *pairs = got
        frames = {
            int(name[len(_FRAME) :]): base64.b64decode(value)
            for name, value in zip(pairs[::2], pairs[1::2], strict=True)
        }
        return Claim(int(fence), StoredSession.from_json(raw), frames)

    async def write(
        self,
        session_id: str,
        fence: int,
        state: StoredSession,
        grace_s: float,
        *,
        frames: Mapping[int, bytes] | None = None,
        drop_frames: Iterable[int] = (),
    ) -> bool:
        """Write the session's record at a fold, with the frames it adds (`frames`, by segment
        index) and without those its eviction dropped; False if another replica holds it now."""
        raw = state.to_json()
        drop = [_FRAME + str(i) for i in drop_frames]
        pairs: list[str] = ["state", raw]
        for index, data in (frames or {}).items():
            pairs += [_FRAME + str(index), base64.b64encode(data).decode("ascii")]
        self.bytes_written_last = sum(len(p) for p in pairs[1::2])
        ok = await self._call(
            self._write(
                keys=[self.key(session_id)], args=[fence, _ms(grace_s), len(drop), *drop, *pairs]
            )
        )
        return bool(ok)

    async def refresh(
        self, session_id: str, fence: int, grace_s: float, *, probe: bool = False
    ) -> bool:
        """Keep a held session's hash for one more grace period; False if it is not ours.
        `probe`: the keeper's, which waits the whole socket timeout during an outage."""
        ok = await self._call(
            self._set(keys=[self.key(session_id)], args=[fence, _ms(grace_s)]), probe=probe
        )
        return bool(ok)

    async def give_back(self, session_id: str, fence: int, token: str, grace_s: float) -> bool:
        """Undo a claim this replica could not serve (no room): the presented token works
        again, so the client can try another replica."""
        ok = await self._call(
            self._set(
                keys=[self.key(session_id)],
                args=[fence, _ms(grace_s), "token", digest(token), "lease", ""],
            )
        )
        return bool(ok)

    async def set_token(
        self, session_id: str, fence: int, token_digest: str, grace_s: float
    ) -> bool:
        """A held session's resume token changed on this replica: the store keeps its digest."""
        ok = await self._call(
            self._set(
                keys=[self.key(session_id)], args=[fence, _ms(grace_s), "token", token_digest]
            )
        )
        return bool(ok)

    async def delete(self, session_id: str, fence: int) -> bool:
        """The session closed or expired here: remove it, unless another replica holds it."""
        return bool(await self._call(self._delete(keys=[self.key(session_id)], args=[fence])))


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
