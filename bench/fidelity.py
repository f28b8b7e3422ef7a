"""Fidelity of bounded sessions (issue 4): perplexity of dense vs window vs sink + window.

vLLM 0.32 returns prompt logprobs only for the first chunk of a streaming-input request, so the
session cannot be scored through the engine. Instead this script replays exactly what the engine
does, with transformers' SmolLM2-135M (float32, eager attention):

* the text is fed in chunks (``--chunk`` tokens) into one KV cache (``DynamicCache``);
* at each fold (before the next chunk is computed) the previous chunk is recorded with
  :func:`retention.policy.append_segment`, :func:`retention.policy.plan_eviction` decides the
  ranges (block size 32, inward alignment, ``protected_tail_tokens=0`` as in
  ``retention/vllm_adapter/eviction.py``), the cached keys/values of every layer are sliced along
  the sequence dimension, and :func:`retention.policy.apply_eviction` updates the history;
* the next chunk continues at the ORIGINAL positions (``position_ids = next_position() ...``),
  so survivors keep the K/V computed with full context (see tests/retention/test_text_retention.py);
* when the next chunk would pass ``--max-position`` (default: the model's
  ``max_position_embeddings``, as the engine's scheduler uses), the session consolidates like the
  engine: survivors re-prefilled at ``0 .. n-1`` together with the incoming chunk.

Each token is scored by its log-likelihood under the logits of the previous position (the first
token of a chunk from the last logits of the previous chunk; the very first token is not scored).
Perplexity is reported per 1k-token bucket of the text.

Usage (all configurations in one process; the defaults score 20480 tokens, which is much more
than a shared 2-core machine affords, see docs/fidelity.md for the sizes actually run)::

    .venv/bin/python -m bench.fidelity --plot docs/fidelity.png

or one configuration per process (``--configs dense`` ...; ``--json`` each), then
``--merge a.json b.json ... --plot docs/fidelity.png`` to build the table and plot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from realtime.models import model_dir
from retention.policy import (
    RetentionBudget,
    SessionHistory,
    append_segment,
    apply_eviction,
    consolidate,
    needs_consolidation,
    plan_eviction,
)

MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 32
# Newton's "Opticks" (4th ed., 1730; public domain), a Project Gutenberg transcription (PG
# Distributed Proofreaders; the PG header is stripped), shipped as libbacktrace test data inside
# the apache-tvm-ffi wheel (PyPI; pulled in by vLLM through xgrammar).
DEFAULT_TEXT = ("tvm_ffi", "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt")


@dataclass(frozen=True)
class Config:
    name: str
    budget: RetentionBudget | None  # None: dense, no eviction
    max_tokens: int  # how much of the text this configuration scores


def default_text() -> Path:
    spec = importlib.util.find_spec(DEFAULT_TEXT[0])
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {DEFAULT_TEXT[0]} not installed; pass --text FILE")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_TEXT[1]


def slice_cache(cache: Any, ranges: tuple[tuple[int, int], ...]) -> None:
    """Drop the cache-coordinate ranges from every layer's keys/values (then compacted)."""
    import torch

    length = cache.get_seq_length()
    keep = torch.ones(length, dtype=torch.bool)
    for a, b in ranges:
        keep[a:b] = False
    index = keep.nonzero().squeeze(1)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


def run_config(model: Any, ids: list[int], cfg: Config, chunk: int, max_position: int) -> dict:
    """Replay one session; returns per-token NLL (index = token position in the text)."""
    import torch

    budget = cfg.budget
    history = SessionHistory.for_budget(budget) if budget else SessionHistory()
    held: list[int] = []  # token ids in cache order
    cache: Any = None
    prev_logits: Any = None  # last logits of the previous chunk
    pending = 0  # tokens of the previous chunk, recorded at the next fold
    nll: dict[int, float] = {}
    evictions = max_held = 0
    consolidated_at: list[int] = []  # text index of the chunks that triggered a re-prefill
    ids = ids[: cfg.max_tokens]
    for s in range(0, len(ids), chunk):
        piece = ids[s : s + chunk]
        # -- the fold (engine: SessionRetention.after_fold)
        if pending:
            history = append_segment(history, "text", pending)
        if budget is not None:
            plan = plan_eviction(history, budget, BLOCK_SIZE, protected_tail_tokens=0)
            if plan.ranges:
                slice_cache(cache, plan.ranges)
                keep = [True] * len(held)
                for a, b in plan.ranges:
                    keep[a:b] = [False] * (b - a)
                held = [t for t, k in zip(held, keep, strict=True) if k]
                evictions += 1
            if not plan.is_empty:
                history = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
        assert history.num_tokens == len(held) == (cache.get_seq_length() if cache else 0)
        reprefill = budget is not None and needs_consolidation(
            history, budget, len(piece), max_position
        )
        # -- the chunk's forward pass
        with torch.inference_mode():
            if reprefill:
                history = consolidate(history)
                consolidated_at.append(s)
                tokens = held + piece
                out = model(
                    input_ids=torch.tensor([tokens]),
                    position_ids=torch.arange(len(tokens)).unsqueeze(0),
                    use_cache=True,
                )
                logits = out.logits[0, len(held) - 1 :].float()
                prev_logits, logits = logits[0], logits[1:]
            else:
                start = history.next_position()
                out = model(
                    input_ids=torch.tensor([piece]),
                    position_ids=torch.arange(start, start + len(piece)).unsqueeze(0),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits = out.logits[0].float()
            cache = out.past_key_values
            logp = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(piece)
            if len(piece) > 1:
                lp = logp[:-1].gather(1, target[1:, None]).squeeze(1)
                for j, v in enumerate(lp.tolist(), start=s + 1):
                    nll[j] = -v
            if prev_logits is not None:
                nll[s] = -torch.log_softmax(prev_logits, dim=-1)[piece[0]].item()
            prev_logits = logits[-1]
        held += piece
        pending = len(piece)
        max_held = max(max_held, len(held))
    return {
        "nll": nll,
        "evictions": evictions,
        "consolidated_at": consolidated_at,
        "max_held": max_held,
    }


def buckets(nll: dict[int, float], size: int) -> list[float]:
    sums: dict[int, list[float]] = {}
    for i, v in nll.items():
        sums.setdefault(i // size, []).append(v)
    return [math.exp(sum(v) / len(v)) for _, v in sorted(sums.items())]


def check_dense(model: Any, ids: list[int], chunk: int) -> float:
    """Chunked-with-cache scoring equals one forward pass (sanity of the replay itself)."""
    import torch

    n = min(len(ids), 4 * chunk)
    res = run_config(model, ids, Config("check", None, n), chunk, max_position=10**9)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids[:n]]))
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    ref = -logp[:-1].gather(1, torch.tensor(ids[1:n])[:, None]).squeeze(1)
    return max(abs(res["nll"][j + 1] - ref[j].item()) for j in range(n - 1))


def report(results: dict[str, dict], args: argparse.Namespace, title: str) -> None:
    """Print the markdown table (per ``--bucket``); plot (per ``--plot-bucket``) and dump JSON."""
    # Markdown table: one row per bucket.
    names = list(results)
    bucket = next(iter(results.values())).get("bucket", args.bucket)
    plot_bucket = next(iter(results.values())).get("plot_bucket", args.plot_bucket)
    nb = max(len(r["ppl_per_bucket"]) for r in results.values())
    print(f"| tokens | {' | '.join(names)} |")
    print("|---:|" + "---:|" * len(names))
    for b in range(nb):
        cells = []
        for n in names:
            v = results[n]["ppl_per_bucket"]
            cells.append(f"{v[b]:.2f}" if b < len(v) else "")
        lo, hi = b * bucket, (b + 1) * bucket
        print(f"| {lo}-{hi} | {' | '.join(cells)} |")
    totals = " | ".join(f"{results[n]['ppl_total']:.2f}" for n in names)
    print(f"| all | {totals} |")

    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for n in names:
            v = results[n]["ppl_per_plot_bucket"]
            xs = [(b + 0.5) * plot_bucket / 1000 for b in range(len(v))]
            ax.plot(xs, v, marker="o", markersize=3, label=n)
        marks = sorted({i for r in results.values() for i in r["consolidated_at"]})
        for i in marks:
            ax.axvline(i / 1000, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("position in text (k tokens)")
        ax.set_ylabel(f"perplexity per {plot_bucket} tokens (log)")
        ax.set_title(title)
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: Opticks)")
    p.add_argument("--tokens", type=int, default=20480, help="tokens scored (evicting configs)")
    p.add_argument("--dense-tokens", type=int, default=2048, help="tokens scored by dense")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--window", type=int, default=256, help="window_tokens")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--bucket", type=int, default=1000)
    p.add_argument("--max-position", type=int, default=None, help="default: model's trained range")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    p.add_argument("--plot-bucket", type=int, default=256, help="bucket of the plot (tokens)")
    p.add_argument(
        "--configs",
        default="dense,window,sink-tokens,sink-chunk",
        help="comma-separated subset of: dense, window, sink-tokens, sink-chunk",
    )
    p.add_argument("--json", type=Path, default=None, help="write per-bucket results here")
    p.add_argument("--no-check", action="store_true", help="skip the replay sanity check")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="no model run: merge --json files of earlier runs into one table/plot",
    )
    return p


def _load(args: argparse.Namespace) -> tuple[Any, Any, list[int], Path, int]:
    """The model, its tokenizer, the text's token ids, the text's path, the position limit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    path = model_dir(MODEL)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    max_position = args.max_position or int(model.config.max_position_embeddings)

    text_path = args.text or default_text()
    text = text_path.read_text(encoding="utf-8")
    text = text[: 8 * max(args.tokens, args.dense_tokens)]  # ~4 chars per token: ample
    ids = tok(text, add_special_tokens=False)["input_ids"]
    print(f"text: {text_path.name}, first {len(text)} chars, {len(ids)} tokens", file=sys.stderr)
    if len(ids) < args.tokens:
        print(f"warning: text has only {len(ids)} tokens", file=sys.stderr)

    if not args.no_check:  # the replay must compute what one dense forward pass does
        diff = check_dense(model, ids, args.chunk)
        print(f"check: chunked replay vs one forward, max |dNLL| = {diff:.2e}", file=sys.stderr)
        if diff > 1e-3:
            raise SystemExit("replay does not match a dense forward pass")

    return model, tok, ids, text_path, max_position


def _configs(args: argparse.Namespace) -> list[Config]:
    w, st = args.window, args.sink_tokens
    known = {
        "dense": Config("dense", None, args.dense_tokens),
        "window": Config(f"window {w}", RetentionBudget(window_tokens=w), args.tokens),
        "sink-tokens": Config(
            f"sink {st} tok + window {w}",
            RetentionBudget(sink_tokens=st, window_tokens=w),
            args.tokens,
        ),
        "sink-chunk": Config(
            f"sink 1 chunk + window {w}",
            RetentionBudget(sink_chunks=1, window_tokens=w),
            args.tokens,
        ),
    }
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(known)}")
    return [known[c] for c in wanted]


def _score(
    model: Any, ids: list[int], cfg: Config, args: argparse.Namespace, max_position: int
) -> dict[str, Any]:
    """One configuration's replay, summarised (perplexity per bucket, evictions, time)."""
    t0 = time.perf_counter()
    res = run_config(model, ids, cfg, args.chunk, max_position)
    ppl = buckets(res["nll"], args.bucket)
    total = math.exp(sum(res["nll"].values()) / len(res["nll"]))
    result = {
        "ppl_per_bucket": ppl,
        "bucket": args.bucket,
        "plot_bucket": args.plot_bucket,
        "ppl_per_plot_bucket": buckets(res["nll"], args.plot_bucket),
        "ppl_total": total,
        "tokens": len(res["nll"]) + 1,
        "evictions": res["evictions"],
        "consolidated_at": res["consolidated_at"],
        "max_held": res["max_held"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(
        f"{cfg.name}: ppl {total:.2f} over {len(res['nll'])} tokens, "
        f"{res['evictions']} evictions, consolidations at {res['consolidated_at']}, "
        f"max held {res['max_held']}, {result['seconds']} s",
        file=sys.stderr,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.merge:
        merged: dict[str, dict] = {}
        for f in args.merge:
            merged.update(json.loads(f.read_text()))
        report(merged, args, f"SmolLM2-135M, chunk {args.chunk}, block {BLOCK_SIZE}")
        return 0

    model, _tok, ids, text_path, max_position = _load(args)
    results = {cfg.name: _score(model, ids, cfg, args, max_position) for cfg in _configs(args)}
    report(results, args, f"SmolLM2-135M, {text_path.name}, chunk {args.chunk}, block {BLOCK_SIZE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
