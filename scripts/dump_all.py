"""Dump every example through every stage, at several world sizes, into one folder.

    python scripts/dump_all.py OUT_DIR [--quick]

Each file under OUT_DIR is what ``purlinc`` prints (stdout, then stderr and the exit status
when either is not empty/zero) for one command line: ``dump`` at every stage (ast, spec, snac,
cuda; text and JSON), every algorithm with and without packing and registered buffers,
every atom and a few dtypes, hierarchical plans, ``check`` and ``draw``.  Two trees made from
two commits compare with ``diff -r``: a refactor that changes no behaviour leaves them
byte-identical.  The command line is the interface dumped (not internal functions), so the
script runs unchanged on both sides of a refactor.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from purlinc.cli import main  # noqa: E402  (after the path: runs from a checkout)

RANKS = (1, 2, 3, 4, 8)
ALGORITHMS = ("direct-push", "direct-pull", "two-shot", "ring")
ATOMS = ("ldst", "tma")
DTYPES = ("bfloat16", "float32", "float8_e4m3")


def _run(argv: list[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:  # argparse rejects a choice
            status = exit_.code
    text = out.getvalue()
    if err.getvalue() or status:
        text += f"\n--- stderr ---\n{err.getvalue()}--- status {status} ---\n"
    return text


def _commands(example: Path, quick: bool):
    """(name, argv) for every command dumped for ``example``."""
    file = str(example)
    params = ["-p", "root=1"] if example.stem in ("broadcast", "gather", "reduce", "scatter") else []
    yield "ast", ["dump", file, "-s", "ast"]
    for R in RANKS[:3] if quick else RANKS:
        base = [file, "-R", str(R), *params]
        yield f"R{R}.spec", ["dump", *base, "-s", "spec"]
        yield f"R{R}.spec.json", ["dump", *base, "-s", "spec", "--json"]
        for algorithm in ALGORITHMS:
            for variant, extra in (("", []), (".packed", ["--packed"]), (".reg", ["--registered", "both"]),
                                   (".c1", ["--stage-copies", "1"]), (".ch2s2", ["--channels", "2", "--slices", "2"])):
                opts = ["-a", algorithm, *extra]
                yield f"R{R}.{algorithm}{variant}.snac", ["dump", *base, "-s", "snac", *opts]
                yield f"R{R}.{algorithm}{variant}.snac.json", ["dump", *base, "-s", "snac", "--json", *opts]
                yield f"R{R}.{algorithm}{variant}.cuda", ["dump", *base, "-s", "cuda", *opts]
        yield f"R{R}.ring.slots2.snac", ["dump", *base, "-s", "snac", "-a", "ring", "--slots", "2"]
        for atom in ATOMS:
            for dtype in DTYPES:
                yield f"R{R}.{atom}.{dtype}.cuda", ["dump", *base, "-s", "cuda", "--atom", atom, "--dtype", dtype,
                                                    "--arch", "sm_90"]
        yield f"R{R}.sm80.cuda", ["dump", *base, "-s", "cuda", "--arch", "sm_80"]
        yield f"R{R}.ce.snac", ["dump", *base, "-s", "snac", "--atom", "ce"]
        if R % 2 == 0 and R > 2:
            yield f"R{R}.hier2.snac", ["dump", *base, "-s", "snac", "--gpus-per-node", "2"]
            yield f"R{R}.hier2.snac.json", ["dump", *base, "-s", "snac", "--json", "--gpus-per-node", "2"]
            yield f"R{R}.hier2.svg", ["draw", *base, "--gpus-per-node", "2"]
        yield f"R{R}.svg", ["draw", *base]
        yield f"R{R}.timeline.svg", ["draw", *base, "--timeline"]
        yield f"R{R}.compare.svg", ["draw", *base, "--compare", "ring,direct-push"]
    yield "check", ["check", file, "-R", "1..8", "-j", "1", *params]
    yield "check.hier", ["check", file, "-R", "2..8", "-j", "1", "--gpus-per-node", "2", *params]


def main_(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true", help="R in 1..3 only")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    import os

    os.chdir(ROOT)  # example paths are written relative to the checkout
    count = 0
    examples = ROOT / "examples"
    for example in sorted(examples.rglob("*.pln")):  # fused/ and sized/ too: epilogues, run-time sizes
        folder = args.out / example.relative_to(examples).with_suffix("")
        folder.mkdir(parents=True, exist_ok=True)
        for name, command in _commands(example.relative_to(ROOT), args.quick):
            (folder / name).write_text(_run(command), encoding="utf-8")
            count += 1
    digest = hashlib.sha256()
    for path in sorted(args.out.rglob("*")):
        if path.is_file() and path.name != "SHA256":
            digest.update(str(path.relative_to(args.out)).encode() + b"\0" + path.read_bytes())
    (args.out / "SHA256").write_text(digest.hexdigest() + "\n")
    print(f"{count} dumps in {args.out}, sha256 {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
