"""Does vLLM's CPU oneDNN matmul keep memory per distinct row count? (docs/reliability.md, Soak)

    .venv/bin/python -m bench.onednn_growth --handlers 8 --max-rows 399

Builds `--handlers` oneDNN linear handlers the way vLLM's CPU linear layers do
(`ops.create_onednn_mm(weight.t(), 32)`), runs each on M = 1..max_rows rows, then does the same
pass again, and prints glibc's bytes in use (mallinfo2) against the baseline: growth in the first
pass that stays flat in the second means memory kept per distinct M. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--handlers", type=int, default=8)
    parser.add_argument("--max-rows", type=int, default=399)
    parser.add_argument("--in-features", type=int, default=1536)
    parser.add_argument("--out-features", type=int, default=576)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from vllm import _custom_ops as ops

    from retention.vllm_adapter.diagnostics import malloc_info

    def in_use() -> int:
        info = malloc_info()
        assert info is not None, "needs glibc (mallinfo2)"
        return info["in_use"]

    torch.manual_seed(0)
    weight = torch.randn(args.out_features, args.in_features)
    handlers = [ops.create_onednn_mm(weight.t(), 32) for _ in range(args.handlers)]
    base = in_use()
    passes = []
    for _ in range(2):
        for m in range(1, args.max_rows + 1):
            x = torch.randn(m, args.in_features)
            for h in handlers:
                ops.onednn_mm(h, x, None)
            del x
        passes.append(in_use() - base)
    per_entry = passes[0] / (args.handlers * args.max_rows)
    print(
        json.dumps(
            {
                "handlers": args.handlers,
                "distinct_rows": args.max_rows,
                "weight": [args.out_features, args.in_features],
                "bytes_in_use_after_first_pass": passes[0],
                "bytes_in_use_after_second_pass": passes[1],
                "bytes_per_handler_per_distinct_m": round(per_entry),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
