"""Long fuzz: ≥100,000 adversarial cases through the codec, the state machine and the media
decoders, judged by the oracle of tests/reliability/fuzzcore.py (documented errors only).

    .venv/bin/python -m tests.reliability.fuzz_long                 # 100,000 cases, seed "fuzz-long"
    .venv/bin/python -m tests.reliability.fuzz_long --cases 1000000 --seed nightly --json out.json

Each case has its own seed (`<seed>-<kind>-<n>`), so a failure is replayed with
`--replay <case seed>`. Bounded: a case count and a wall-clock budget (`--max-seconds`).
Exit status 1 on the first oracle violation (after printing its seed), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# Case mix: parse-only cases are cheap, media decodes and whole sessions cost more.
WEIGHTS = {"parse": 5, "session": 3, "media": 2}


def _quiet_decoders() -> None:
    """FFmpeg logs every corrupt packet; a million of them help nobody."""
    try:
        import av.logging

        av.logging.set_level(None)
    except Exception:
        pass


def run(cases: int, seed: str, max_seconds: float, progress: bool = True) -> dict[str, Any]:
    from tests.reliability import fuzzcore as fc

    fc.media_seeds()
    kinds = [k for k, w in WEIGHTS.items() for _ in range(w)]
    by_kind: Counter[str] = Counter()
    by_case: Counter[str] = Counter()
    slowest: list[tuple[float, str]] = []
    started = time.perf_counter()
    done = 0
    for n in range(cases):
        if time.perf_counter() - started > max_seconds:
            break
        kind = kinds[n % len(kinds)]
        case_seed = f"{seed}-{kind}-{n}"
        t0 = time.perf_counter()
        try:
            label = fc.CASES[kind](random.Random(case_seed))
        except Exception as exc:
            return {
                "ok": False,
                "cases": done,
                "failed_seed": case_seed,
                "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                "seconds": round(time.perf_counter() - started, 1),
            }
        took = time.perf_counter() - t0
        slowest = sorted([*slowest, (took, case_seed)], reverse=True)[:5]
        done += 1
        by_kind[kind] += 1
        by_case[label] += 1
        if progress and done % 10_000 == 0:
            rate = done / (time.perf_counter() - started)
            print(f"{done:>9,} cases  {rate:,.0f}/s", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    return {
        "ok": True,
        "cases": done,
        "seconds": round(elapsed, 1),
        "cases_per_s": round(done / elapsed, 1) if elapsed else None,
        "by_kind": dict(by_kind),
        "by_case": dict(sorted(by_case.items())),
        "slowest_cases": [{"seconds": round(t, 3), "seed": s} for t, s in slowest],
        "seed": seed,
    }


def replay(case_seed: str) -> int:
    from tests.reliability import fuzzcore as fc

    kind = case_seed.rsplit("-", 2)[-2]
    print(fc.CASES[kind](random.Random(case_seed)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", default="fuzz-long")
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--replay", default=None, help="run one case seed, raise on failure")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _quiet_decoders()
    if args.replay:
        return replay(args.replay)
    result = run(args.cases, args.seed, args.max_seconds)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
