"""`vllm-realtime selfcheck`: bounded sessions checked against their oracle on this machine.

What a user runs before trusting a deployment: a tiny random Llama is built locally (no
download), the real vLLM engine is started the way `serve` starts it (our scheduler, worker
hooks and runner selection; plus the read-only introspection utilities, which report what the
cache holds), and bounded sessions are driven through eviction, consolidation (re-prefill, and
rotation where the engine offers it) and a preemption. Every reply's log-probs are compared with
a dense transformers forward over what the cache actually holds (retention/selfcheck.py), and
every KV block must be back in the pool at the end. One line per check; the exit status is 0
only if none failed.

The preemption goes through vLLM's own `reset_prefix_cache(reset_running_requests=True)` while
the session's reply decodes beside a plain request: it preempts through the same
`Scheduler._preempt_request` as KV pressure does (tests/retention/test_preemption.py explains
why a pool-exhaustion setup is timing-bound).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retention.selfcheck import (
    TEXT_TOLERANCE,
    causal_visibility,
    chunk_visibility,
    compare_logprobs,
    dense_logprobs,
    masked_logprobs,
)
from retention.vllm_adapter.rendering import render_prompt

CHUNK_TOKENS = 24
TOP_K = 5
KV_BYTES = 16 << 20
BLOCK_SIZE = 32
HALF_TOLERANCE = 0.15
"""|Δ log-prob| allowed when the engine runs in bfloat16/float16 against the float32 oracle
(the argmax is then not compared). The tiny model's log-probs move by > 1 under a wrong
position or mask (INIT_RANGE in realtime/models/tiny_llama.py)."""
PREEMPTION_TRIES = 3


@dataclass
class CheckResult:
    name: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str
    worst_delta: float | None = None
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail} ({self.seconds:.1f} s)"


@dataclass
class SelfcheckReport:
    vllm_version: str = ""
    device: str = ""
    model_runner: str = ""
    dtype: str = ""
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.status != "FAIL" for c in self.checks)


class CheckFailed(AssertionError):
    """A check's condition did not hold (its message is the FAIL line's detail)."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Session:
    """One bounded streaming session, one chunk in flight (as the server sends them)."""

    def __init__(self, engine: Any, budget: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.request_id = f"selfcheck-{uuid.uuid4().hex[:12]}"
        self.inputs: asyncio.Queue[Any] = asyncio.Queue()
        self.params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=TOP_K,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"streaming_retention": budget},
        )
        self.outputs: Any = None

    async def _stream(self) -> AsyncIterator[Any]:
        while True:
            item = await self.inputs.get()
            if item is None:
                return
            yield item

    async def send(
        self,
        token_ids: list[int],
        *,
        max_tokens: int = 1,
        after_first_token: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[list[int], list[dict[int, float]]]:
        """The chunk's reply: its token ids and, per token, the top log-probs."""
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        params = self.params.clone()
        params.max_tokens = max_tokens
        prompt = await render_prompt(self.engine, TokensPrompt(prompt_token_ids=token_ids))
        self.inputs.put_nowait(StreamingInput(prompt=prompt, sampling_params=params))
        if self.outputs is None:
            self.outputs = self.engine.generate(
                self._stream(), self.params, request_id=self.request_id
            )
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []
        while True:
            out = await self.outputs.__anext__()
            require(not out.finished, "the engine ended a bounded session on its own")
            completion = out.outputs[0]
            first = not tokens and bool(completion.token_ids)
            tokens.extend(completion.token_ids)
            for entry in completion.logprobs or []:
                logprobs.append({tok: lp.logprob for tok, lp in entry.items()})
            if completion.finish_reason is not None:
                return tokens, logprobs
            if first and after_first_token is not None:
                await after_first_token()

    async def state(self) -> dict[str, Any]:
        from retention.vllm_adapter.introspect import retention_state

        state = await retention_state(self.engine, self.request_id)
        require(state is not None, "the engine keeps no retention state for the session")
        assert state is not None
        return state

    async def close(self) -> None:
        if self.outputs is not None:
            await self.outputs.aclose()
        await self.engine.abort(self.request_id)


class Chunks:
    """Random token ids, distinct per session (no prefix-cache hit between checks)."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def next(self, n: int = CHUNK_TOKENS) -> list[int]:
        return [self.rng.randrange(0, self.vocab) for _ in range(n)]


class Checker:
    def __init__(self, engine: Any, hf_model: Any, vocab: int, half: bool) -> None:
        self.engine = engine
        self.hf_model = hf_model
        self.vocab = vocab
        self.tolerance = HALF_TOLERANCE if half else TEXT_TOLERANCE
        self.check_argmax = not half
        self.seed = 0

    def chunks(self) -> Chunks:
        self.seed += 1
        return Chunks(self.seed, self.vocab)

    def within(self, got: dict[int, float], want: Any, where: str) -> float:
        """Compare one step with its oracle; the worst |Δ|, or CheckFailed."""
        result = compare_logprobs(got, want)
        require(
            result.worst_delta < self.tolerance,
            f"{where}: |Δ log-prob| {result.worst_delta:.2e} >= {self.tolerance:.0e}",
        )
        require(result.same_argmax or not self.check_argmax, f"{where}: greedy token differs")
        return result.worst_delta

    async def eviction(self) -> tuple[str, float]:
        session = Session(self.engine, {"sink_chunks": 1, "window_chunks": 2})
        chunks = self.chunks()
        tokens: list[int] = []  # every token sent; index == original position
        visible: list[list[int]] = []
        worst = 0.0
        after_eviction = 0
        try:
            system = chunks.next()
            await session.send(system)
            tokens += system
            visible += causal_visibility(len(system))
            for i in range(8):
                chunk = chunks.next()
                _, logprobs = await session.send(chunk)
                state = await session.state()
                held, cursor = state["history_positions"], state["position_cursor"]
                require(cursor == len(tokens), f"chunk {i}: position {cursor} != {len(tokens)}")
                require(
                    [tokens[p] for p in held] == state["token_ids"],
                    f"chunk {i}: the cache's tokens are not those sent at its positions",
                )
                visible += chunk_visibility(held, cursor, len(chunk))
                tokens += chunk
                want = masked_logprobs(self.hf_model, tokens, visible)
                worst = max(worst, self.within(logprobs[0], want, f"chunk {i}"))
                if state["tokens_evicted"]:
                    after_eviction += 1
                    # The oracle tells a wrong cache apart: the survivors alone, recomputed at
                    # their positions, are a different function (retention/selfcheck.py).
                    survivors = state["token_ids"] + chunk
                    alone = dense_logprobs(
                        self.hf_model, survivors, held + list(range(cursor, cursor + len(chunk)))
                    )
                    apart = compare_logprobs(logprobs[0], alone).worst_delta
                    require(
                        apart > 10 * self.tolerance,
                        f"chunk {i}: the oracle does not discriminate ({apart:.2e})",
                    )
            require(after_eviction >= 2, f"only {after_eviction} replies after an eviction")
            evicted = state["tokens_evicted"]
        finally:
            await session.close()
        return f"{after_eviction} replies after eviction ({evicted} tokens evicted)", worst

    async def reprefill(self) -> tuple[str, float]:
        budget = {
            "sink_chunks": 1,
            "window_chunks": 2,
            "max_position": 200,
            "consolidation": "reprefill",
        }
        session = Session(self.engine, budget)
        chunks = self.chunks()
        checked = 0
        worst = 0.0
        try:
            await session.send(chunks.next())
            seen = 0
            for _ in range(20):
                chunk = chunks.next()
                _, logprobs = await session.send(chunk)
                state = await session.state()
                require(state["position_cursor"] <= 200, "positions passed max_position")
                if state["consolidations"] > seen:
                    seen = state["consolidations"]
                    held = state["token_ids"]
                    require(
                        state["history_positions"] == list(range(len(held))),
                        "after a consolidation the survivors are not at 0..n-1",
                    )
                    tokens = held + chunk
                    want = dense_logprobs(self.hf_model, tokens, list(range(len(tokens))))
                    worst = max(worst, self.within(logprobs[0], want, f"consolidation {seen}"))
                    checked += 1
                    if checked == 2:
                        break
            require(checked >= 2, f"{checked} consolidations in 20 chunks")
        finally:
            await session.close()
        return f"{checked} re-prefills equal a fresh prefill of the survivors", worst

    async def rotation(self) -> tuple[str | None, float]:
        """None: this engine does not rotate (a re-prefill is its only consolidation)."""
        window = {"sink_chunks": 0, "window_chunks": 2, "consolidation": "rotate"}
        rotating = Session(self.engine, {**window, "max_position": 200})
        twin = Session(self.engine, {**window, "max_position": 4000})
        chunks = self.chunks()
        worst = 0.0
        try:
            for i in range(20):
                chunk = chunks.next()
                (_, got), (_, want) = await asyncio.gather(rotating.send(chunk), twin.send(chunk))
                state = await rotating.state()
                if state["consolidation"] != "rotate":
                    return None, 0.0
                # RoPE depends on position differences only: rotating a contiguous window
                # changes no log-prob of a twin that never consolidates.
                common = {t: lp for t, lp in got[0].items() if t in want[0]}
                require(bool(common), f"chunk {i}: no common top token with the twin")
                delta = max(abs(lp - want[0][t]) for t, lp in common.items())
                require(delta < self.tolerance, f"chunk {i}: |Δ| vs the twin {delta:.2e}")
                worst = max(worst, delta)
                if state["rotations"] >= 2:
                    break
            require(state["rotations"] >= 2, f"{state['rotations']} rotations in 20 chunks")
            require(state["rotation_fallbacks"] == 0, "a rotation fell back to a re-prefill")
            twin_state = await twin.state()
            require(twin_state["consolidations"] == 0, "the twin consolidated")
            rotations = state["rotations"]
        finally:
            await rotating.close()
            await twin.close()
        return f"{rotations} rotations equal a twin that never consolidates", worst

    async def _competitor(self, chunks: Chunks) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=2 * BLOCK_SIZE, temperature=0.0, ignore_eos=True)
        prompt = await render_prompt(
            self.engine, TokensPrompt(prompt_token_ids=chunks.next(3 * BLOCK_SIZE))
        )
        async for _ in self.engine.generate(
            prompt, params, request_id=f"selfcheck-plain-{uuid.uuid4().hex[:8]}"
        ):
            pass

    async def preemption(self) -> tuple[str, float]:
        session = Session(self.engine, {"sink_chunks": 1, "window_chunks": 2})
        chunks = self.chunks()

        async def preempt() -> None:
            require(
                await self.engine.reset_prefix_cache(reset_running_requests=True),
                "vLLM refused to reset the prefix cache",
            )

        try:
            for _ in range(6):
                await session.send(chunks.next())
            before = await session.state()
            require(before["tokens_evicted"] > 0, "nothing evicted before the preemption")
            for _ in range(PREEMPTION_TRIES):
                big = chunks.next(2 * CHUNK_TOKENS)
                competitor = asyncio.create_task(self._competitor(chunks))
                reply, _ = await session.send(
                    big, max_tokens=2 * BLOCK_SIZE, after_first_token=preempt
                )
                await competitor
                state = await session.state()
                if state["preemptions"] >= 1:
                    break
            require(state["preemptions"] >= 1, f"not preempted in {PREEMPTION_TRIES} tries")
            held = state["token_ids"]
            require(
                state["history_positions"] == list(range(len(held))),
                "the resumed session's survivors are not at 0..n-1",
            )
            # Since the resume: a fresh prefill at 0..; the next chunk sees what the cache holds.
            fresh = [*held, *big, *reply[:-1]]
            nxt = chunks.next()
            _, logprobs = await session.send(nxt)
            after = await session.state()
            cursor = after["position_cursor"]
            require(cursor == len(fresh), f"position {cursor} != {len(fresh)} after the resume")
            visible = causal_visibility(len(fresh))
            visible += chunk_visibility(after["history_positions"], cursor, len(nxt))
            want = masked_logprobs(self.hf_model, [*fresh, *nxt], visible)
            worst = self.within(logprobs[0], want, "after the resume")
            preemptions = state["preemptions"]
        finally:
            await session.close()
        return f"{preemptions} preemption(s); the resumed session equals its oracle", worst

    async def blocks_returned(self, usable: int) -> str:
        from retention.vllm_adapter.introspect import kv_stats

        for _ in range(100):
            stats = await kv_stats(self.engine)
            if stats["num_free_blocks"] == usable:
                return f"all {usable} blocks free after close"
            await asyncio.sleep(0.05)
        raise CheckFailed(f"{usable - stats['num_free_blocks']} of {usable} blocks still held")


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"CUDA: {torch.cuda.get_device_name(0)}"
    from vllm.platforms import current_platform

    return f"{current_platform.device_type.upper()} (torch {torch.__version__})"


async def _timed(
    report: SelfcheckReport, name: str, run: Callable[[], Awaitable[tuple[str | None, float]]]
) -> None:
    start = time.monotonic()
    try:
        detail, worst = await run()
        if detail is None:
            result = CheckResult(name, "SKIP", "this engine consolidates by re-prefill only")
        else:
            result = CheckResult(name, "PASS", f"{detail}; worst |Δ log-prob| {worst:.1e}", worst)
    except CheckFailed as failed:
        result = CheckResult(name, "FAIL", str(failed))
    except Exception as error:  # the engine itself failed: report it as this check's failure
        result = CheckResult(name, "FAIL", f"{type(error).__name__}: {error}")
    result.seconds = time.monotonic() - start
    report.checks.append(result)
    print(result.line(), flush=True)


async def run_checks(model_dir: Path, dtype: str, report: SelfcheckReport) -> None:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from realtime.engine import EngineSettings, start_engine
    from retention.vllm_adapter.introspect import kv_stats, worker_stats

    report.vllm_version = vllm.__version__
    report.dtype = dtype
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    settings = EngineSettings(
        model=str(model_dir),
        max_model_len=1024,
        kv_cache_memory_bytes=KV_BYTES,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        dtype=dtype,
        # The checks read what the cache holds (retention_state, worker_stats).
        introspection=True,
    )
    start = time.monotonic()
    try:
        engine = start_engine(settings)
    except Exception as error:
        report.checks.append(CheckResult("engine", "FAIL", f"{type(error).__name__}: {error}"))
        print(report.checks[-1].line(), flush=True)
        return
    try:
        (worker, *_) = await worker_stats(engine)
        report.model_runner = str(worker.get("model_runner", "unknown"))
        report.device = _device()
        stats = await kv_stats(engine)
        usable = int(stats["num_usable_blocks"])
        engine_check = CheckResult(
            "engine",
            "PASS",
            f"vLLM {report.vllm_version}, {report.device}, model runner {report.model_runner}, "
            f"{dtype}, {usable} KV blocks of {stats['block_size']}",
            seconds=time.monotonic() - start,
        )
        report.checks.append(engine_check)
        print(engine_check.line(), flush=True)
        checker = Checker(engine, hf_model, int(hf_model.config.vocab_size) - 8, dtype != "float32")
        await _timed(report, "eviction", checker.eviction)
        await _timed(report, "consolidation (re-prefill)", checker.reprefill)
        await _timed(report, "consolidation (rotation)", checker.rotation)
        await _timed(report, "preemption", checker.preemption)

        start = time.monotonic()
        try:
            result = CheckResult("blocks returned", "PASS", await checker.blocks_returned(usable))
        except CheckFailed as failed:
            result = CheckResult("blocks returned", "FAIL", str(failed))
        result.seconds = time.monotonic() - start
        report.checks.append(result)
        print(result.line(), flush=True)
    finally:
        engine.shutdown()


def selfcheck(dtype: str = "float32", as_json: bool = False) -> int:
    """Build the tiny model, run every check, print the lines (and the JSON); 0 if all pass."""
    from realtime.models.tiny_llama import build_tiny_llama

    report = SelfcheckReport()
    with tempfile.TemporaryDirectory(prefix="vllm-realtime-selfcheck-") as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        build_tiny_llama(model_dir)
        asyncio.run(run_checks(model_dir, dtype, report))
    failed = [c.name for c in report.checks if c.status == "FAIL"]
    verdict = "PASS" if report.passed else "FAIL"
    summary = f"{verdict} selfcheck: {len(report.checks) - len(failed)}/{len(report.checks)} checks"
    print(summary + (f" (failed: {', '.join(failed)})" if failed else ""), flush=True)
    if as_json:
        print(json.dumps({**asdict(report), "passed": report.passed}), flush=True)
    sys.stdout.flush()
    return 0 if report.passed else 1
