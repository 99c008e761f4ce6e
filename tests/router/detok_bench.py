"""Time per streamed delta of the router's detokenizer at a long output, against the
whole-output decode it replaced (tests/router/detok_reference.py), in one run:

    python -m tests.router.detok_bench [--tokens 32768] [--model DIR]

The output is `--tokens` ids of ordinary text; both detokenizers take all but the last 256 in
one delta, then the last 256 one id at a time, which are timed. Prints one JSON object last."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdcluster.router.api.detokenizer import IncrementalDetokenizer
from pdcluster.router.api.tokenizer import RouterTokenizer
from tests.real_model import real_model_dir
from tests.router.detok_reference import WholeDecodeDetokenizer

TEXT = ("The router streams each sample's text to its client as the tokens arrive; "
        "ünïcödé, 中文, emoji 😀 and code `x = f(y)` included. ")
TIMED = 256


def per_delta_us(detok, ids: list[int]) -> float:
    detok.add(ids[:-TIMED])
    start = time.perf_counter()
    for i in ids[-TIMED:]:
        detok.add([i])
    return (time.perf_counter() - start) / TIMED * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--model", type=Path, default=real_model_dir())
    args = parser.parse_args()
    tok = RouterTokenizer(args.model)
    one = tok.encode(TEXT, add_special_tokens=False)
    ids = (one * (args.tokens // len(one) + 1))[:args.tokens]
    stop = ["never appears in the text"]
    whole = per_delta_us(WholeDecodeDetokenizer(tok, stop), ids)
    window = per_delta_us(IncrementalDetokenizer(tok, stop), ids)
    print(json.dumps({"model": args.model.name, "tokens": args.tokens, "timed_deltas": TIMED,
                      "whole_decode_us_per_delta": round(whole, 1),
                      "window_us_per_delta": round(window, 1),
                      "speedup": round(whole / window, 1)}))


if __name__ == "__main__":
    main()
