#!/usr/bin/env python3
"""Fuzz the front end: every input must end in success or a ``PurlinError``, nothing else.

    python scripts/fuzz.py --count 100000 [--seed 1] [--lower] [--out results.json]

Inputs are mutations of the example .pln files (bytes deleted, duplicated, swapped, replaced
by grammar tokens, huge numbers, deep nesting, invalid UTF-8) and random token streams.
Each goes through the bytes -> text decoder, the parser and the checker (R = 1..4); with
``--lower``, specs that check are also lowered and verified at R = 2 (slower).  Counts are
printed every 10,000 inputs and at the end; the exit status is 1 if any input raised
anything but ``PurlinError`` (each such input is printed, with its traceback, and saved
under --crash-dir), 0 otherwise.

The functions here are also what tests/test_fuzz.py runs (a few seconds, in the default suite).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # benchlib: the benchmarks' argument types

from benchlib import argtypes  # noqa: E402
from purlinc.errors import PurlinError  # noqa: E402

# Every token the grammar knows, plus some it does not.
TOKENS = (
    "collective", "copy", "reduce", "replicated", "in", "out", "for", "where", "r", "R", "x", "y", "root", "i", "j",
    "k", "0", "1", "2", "7", "R-1", "{", "}", "[", "]", "(", ")", ",", ";", "=", "==", "!=", "<", "<=", ">", ">=",
    "+", "-", "*", "/", "%", "..", "//c\n", "/* c */", "/*", "\n", " ", "\t", "\r\n", "sum", "max", "$", "@",
    "9223372036854775808", "99999999999999999999999", "0..1000000000000", "é", "\u202e", "\x0c",
)
HUGE = ("1000000000000", "9" * 30, "9" * 5000, "R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R*R")


def examples() -> list[bytes]:
    return [path.read_bytes() for path in sorted((REPO / "examples").glob("*.pln"))]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four random edits of ``data``."""
    for _ in range(rng.randint(1, 4)):
        n = len(data)
        at = rng.randint(0, n)
        end = min(n, at + rng.randint(0, 12))
        kind = rng.randrange(10)
        if kind == 0:  # delete a span
            data = data[:at] + data[end:]
        elif kind == 1:  # insert a token
            data = data[:at] + rng.choice(TOKENS).encode() + data[at:]
        elif kind == 2:  # replace a span by a token
            data = data[:at] + rng.choice(TOKENS).encode() + data[end:]
        elif kind == 3:  # duplicate a span
            data = data[:end] + data[at:end] + data[end:]
        elif kind == 4:  # a random byte (invalid UTF-8 and control characters included)
            data = data[:at] + bytes([rng.randrange(256)]) + data[at:]
        elif kind == 5:  # a huge number or product
            data = data[:at] + rng.choice(HUGE).encode() + data[end:]
        elif kind == 6:  # deep nesting
            depth = rng.choice((10, 300, 3000))
            inner = rng.choice(("-" * depth + "r", "(" * depth + "r" + ")" * depth, "+".join(["r"] * depth)))
            data = data[:at] + inner.encode() + data[end:]
        elif kind == 7:  # truncate
            data = data[:at]
        elif kind == 8:  # swap two spans
            other = rng.randint(0, n)
            a, b = sorted((at, other))
            data = data[:a] + data[b:b + 3] + data[a + 3:b] + data[a:a + 3] + data[b + 3:]
        else:  # a long line
            data = data[:at] + b"x[r], " * rng.choice((50, 3000)) + data[at:]
    return data


def token_stream(rng: random.Random) -> bytes:
    """A random sequence of tokens, often starting like a collective."""
    head = ["collective", "a", "{"] if rng.random() < 0.7 else []
    body = [rng.choice(TOKENS) for _ in range(rng.randint(0, 40))]
    tail = ["copy", "}"] if rng.random() < 0.5 else []
    return " ".join(head + body + tail).encode("utf-8", "surrogatepass")


def run_one(data: bytes, *, lower: bool = False) -> str:
    """Feed one input through the front end; return the outcome ("ok", "error") or raise
    whatever non-PurlinError escaped."""
    from purlinc.frontend.check import check
    from purlinc.frontend.parse import parse
    from purlinc.frontend.source import decode_source

    try:
        definition = parse(decode_source(data, "fuzz.pln"), "fuzz.pln")
        text = definition.format()
        again = parse(text, "formatted.pln").format()
        if again != text:
            raise AssertionError(f"format does not round-trip:\n{text}\n---\n{again}")
        specs = []
        for world_size in (1, 2, 3, 4):
            try:
                specs.append(check(definition, world_size))
            except PurlinError as error:
                error.render()  # rendering must not fail either
        if lower:
            from purlinc import pipeline

            for spec in specs:
                if spec.world_size == 2:
                    pipeline.snac_stage(spec, pipeline.default_options(spec))
        return "ok" if specs else "error"
    except PurlinError as error:
        error.render()
        return "error"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=argtypes.positive_int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lower", action="store_true", help="also lower and verify specs that check (R=2)")
    parser.add_argument("--out", type=Path, help="write the counts as JSON here")
    parser.add_argument("--crash-dir", type=Path, default=Path("fuzz-crashes"))
    args = parser.parse_args(argv)
    if args.out:  # before the inputs run, not after: a path that cannot be written is a usage error
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a"):
                pass
        except OSError as error:
            parser.error(f"--out {args.out}: cannot write there ({error.strerror or error})")

    rng = random.Random(args.seed)
    seeds = examples()
    counts: Counter[str] = Counter()
    crashes = 0
    slowest = (0.0, b"")
    start = time.monotonic()
    for n in range(1, args.count + 1):
        data = token_stream(rng) if rng.random() < 0.25 else mutate(rng.choice(seeds), rng)
        began = time.monotonic()
        try:
            counts[run_one(data, lower=args.lower)] += 1
        except Exception:  # noqa: BLE001 - the point: anything but PurlinError is a finding
            counts["crash"] += 1
            crashes += 1
            args.crash_dir.mkdir(parents=True, exist_ok=True)
            (args.crash_dir / f"crash-{args.seed}-{n}.pln").write_bytes(data)
            print(f"CRASH on input {n} (saved to {args.crash_dir}/crash-{args.seed}-{n}.pln): {data[:200]!r}")
            traceback.print_exc()
        took = time.monotonic() - began
        if took > slowest[0]:
            slowest = (took, data)
        if n % 10_000 == 0:
            print(f"{n} inputs, {time.monotonic() - start:.0f} s: {dict(counts)}", flush=True)
    elapsed = time.monotonic() - start
    result = {
        "inputs": args.count, "seed": args.seed, "lower": args.lower, "seconds": round(elapsed, 1),
        "outcomes": dict(counts), "crashes": crashes, "slowest_input_seconds": round(slowest[0], 3),
        "slowest_input_bytes": len(slowest[1]), "python": sys.version.split()[0],
    }
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
