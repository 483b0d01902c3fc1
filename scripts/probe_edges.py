#!/usr/bin/env python3
"""Probe Purlin's runtime edge cases on ONE GPU (loopback LocalGroups: every rank on cuda:0,
a stream each) and record what happened, case by case, in $OUT/probe_edges.json.

    OUT=/tmp/probe timeout 300 python3 scripts/probe_edges.py        # the whole probe
    python3 scripts/probe_edges.py --list                             # the cases (no GPU needed)

Layout: this process (the parent) never touches CUDA.  It runs the cases in a child process
(``--child``), which appends a JSON line when a case starts and one when it ends.  A case that
outlives its bound (a hang the device-side bound did not catch) or kills the child (a crash, a
sticky CUDA error) is recorded as such by the parent, which starts a new child at the next
case.  Every case runs in its own try/except in the child; after a PurlinTimeoutError the
failed LocalGroup is dropped and a fresh one is made on next use.

Each row: case, group, expected, happened (ok / wrong result with the first differing indices /
exception type and the first line of its message / timeout / crash), status (ok, unexpected,
note: a deviation in a case whose behaviour no document promises, skipped), seconds, detail.

Environment: OUT (default /tmp); PROBE_BUDGET_S (default 285: the parent stops starting cases
after that and kills the child; the JSON is written throughout); PROBE_ONLY (a regex: run only
the cases whose names match).  For testing the probe itself: PROBE_INJECT ("REGEX=crash",
"=hang" or "=cudafault", ';'-separated: the matching case segfaults, sleeps forever, or leaves a
sticky CUDA error) and PROBE_CASE_BOUND_S (caps every case's bound).  PURLIN_WAIT_TIMEOUT_S is set
to 5 and PURLIN_PRECOMPILE to 0 (the probe compiles exactly the kernels it uses, in parallel,
as its first case).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import zlib
from collections import namedtuple
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
EX = ROOT / "examples"

# Before purlinc is imported anywhere (the child imports it; settings are read at use).
os.environ["PURLIN_WAIT_TIMEOUT_S"] = "5"
os.environ["PURLIN_PRECOMPILE"] = "0"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

DEVICE = 0
PIN = dict(algorithm="direct-push", atom="ldst", channels=2)  # the pinned loads (one kernel per dtype/op)
COUNTS = (0, 1, 3, 7, 1000003)
SWEEP_BYTES = tuple(4 ** k for k in range(14))  # 1 B .. 64 MiB
F32, BF16, F16, I32 = "float32", "bfloat16", "float16", "int32"
FATAL_EXIT = 86  # the child exits with this after a sticky CUDA error: the parent starts a new one

Case = namedtuple("Case", "name group expected fn bound")


class Unexpected(Exception):
    """The case did something no document allows (its text is what happened)."""


class Note(Exception):
    """A deviation in a case whose behaviour is not promised anywhere (informational)."""


# ==========================================================================================
# small helpers (the child's; numpy and torch imported lazily so the parent needs neither)

def first_line(error: BaseException) -> str:
    text = getattr(error, "message", None) or str(error) or type(error).__name__
    return text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__


def full_text(error: BaseException) -> str:
    text = getattr(error, "message", None) or str(error)
    notes = " ".join(getattr(error, "notes", ()) or ())
    return f"{text} {notes}"


def _np():
    import numpy as np
    return np


def dtype_of(name):
    from purlinc.dtypes import DType
    return DType.parse(name)


def torch_dtype(dtype):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "int32": torch.int32, "float64": torch.float64}[dtype.value if hasattr(dtype, "value") else dtype]


def _bits_type(itemsize):
    np = _np()
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]


def to_dev(array, dtype):
    """A NumPy storage array (bf16 as uint16) -> a cuda:0 tensor of ``dtype``."""
    import torch
    np = _np()
    array = np.ascontiguousarray(array)
    if dtype.value == BF16:
        return torch.from_numpy(array.view(np.int16)).to(f"cuda:{DEVICE}").view(torch.bfloat16)
    return torch.from_numpy(array).to(f"cuda:{DEVICE}")


def bits_np(tensor):
    """A device tensor's elements as unsigned bits on the host (any layout)."""
    import torch
    t = tensor.detach().contiguous()
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(signed).cpu().numpy().reshape(-1).view(_bits_type(t.element_size()))


def bits_of(array):
    np = _np()
    return np.ascontiguousarray(array).reshape(-1).view(_bits_type(array.itemsize))


def shown(bits, dtype, idx):
    """Values at ``idx`` for a message: floats as numbers (with their bits), ints as ints."""
    np = _np()
    from purlinc.dtypes import to_float32
    storage = bits[idx].view(dtype.storage) if dtype.value != BF16 else bits[idx]
    if dtype.value == I32:
        return [int(v) for v in storage]
    values = to_float32(np.asarray(storage), dtype)
    return [f"{float(v):.6g}/{int(b):#x}" for v, b in zip(values, bits[idx])]


def poison(tensor):
    """0xFF in every byte: NaN for every float type, -1 for int32."""
    if tensor is None:
        return
    import torch
    if tensor.is_contiguous():
        tensor.view(torch.uint8).fill_(0xFF) if tensor.numel() else None
    elif tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(-1)


def still_poisoned(tensor) -> bool:
    import torch
    if tensor is None or tensor.numel() == 0:
        return True
    if tensor.is_floating_point():
        return bool(torch.isnan(tensor).all().item())
    return bool((tensor == -1).all().item())


def compare(outs, want, dtype, label="", nan_ok=False):
    """Every rank's output equals ``want[r]`` bit for bit (``nan_ok``: a NaN need only be a NaN,
    for float32/float16: the GPU makes its own NaN payloads).  Raises Unexpected naming the rank,
    how many differ, how many still hold the poison, and the first indices with values."""
    np = _np()
    from purlinc.dtypes import to_float32
    for r, out in enumerate(outs):
        if out is None:
            if want[r].size:
                raise Unexpected(f"wrong result{label}: rank {r} has no output but expected {want[r].size} elements")
            continue
        got = bits_np(out)
        exp = bits_of(want[r])
        if got.size != exp.size:
            raise Unexpected(f"wrong result{label}: rank {r} output has {got.size} elements, expected {exp.size}")
        if nan_ok and dtype.value in (F32, F16, BF16):
            g = to_float32(got.view(dtype.storage) if dtype.value != BF16 else got, dtype)
            w = to_float32(exp.view(dtype.storage) if dtype.value != BF16 else exp, dtype)
            gn, wn = np.isnan(g), np.isnan(w)
            bad = (gn != wn) | (~wn & (got != exp))
        else:
            bad = got != exp
        if bad.any():
            idx = np.flatnonzero(bad)
            ones = np.iinfo(got.dtype).max
            left = int((got[idx] == ones).sum())
            raise Unexpected(
                f"wrong result{label}: rank {r}: {idx.size} of {got.size} elements differ "
                f"({left} still poisoned), first at {idx[:5].tolist()}: got {shown(got, dtype, idx[:5])}, "
                f"want {shown(exp, dtype, idx[:5])}")


def same_across_ranks(outs, dtype, label=""):
    """Replicated outputs (an all-reduce's) agree bit for bit (NaN payloads aside)."""
    first = [bits_np(outs[0])]
    for r in range(1, len(outs)):
        compare([outs[r]], first, dtype, f"{label} (rank {r} vs rank 0, replicated output)", nan_ok=True)


# ------------------------------------------------------------------------------------------
# inputs, buffers, references

def make_inputs(spec, count, dtype, rng, kind):
    """One storage array per rank.  kind: 'int' (integer-valued: sums exact in any order, so
    bitwise against the evaluator whatever order a schedule adds in), 'bits' (random bytes, for
    copies), 'normal' (random floats), 'special' (NaN, inf, -0, subnormals, overflow at 10%),
    'i32full' (the whole int32 range: wrapping sums and products), 'negzero' (every element -0)."""
    np = _np()
    from purlinc.dtypes import from_float32, random_values, to_float32
    out = []
    for r in range(spec.world_size):
        n = len(spec.inputs[r]) * count
        if kind == "bits":
            a = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype.storage).copy()
        elif kind == "int":
            if dtype.value == I32:
                a = rng.integers(-(1 << 20), 1 << 20, size=n, dtype=np.int64).astype(np.int32)
            else:
                a = from_float32(rng.integers(-64, 65, size=n, dtype=np.int64).astype(np.float32), dtype)
        elif kind == "i32full":
            a = rng.integers(-(1 << 31), 1 << 31, size=n, dtype=np.int64).astype(np.int32)
            where = rng.random(n) < 0.05
            a[where] = rng.choice(np.array([-(1 << 31), (1 << 31) - 1, 0, -1, 1], dtype=np.int32), size=int(where.sum()))
        elif kind == "negzero":
            a = from_float32(np.full(n, -0.0, dtype=np.float32), dtype)
        elif kind == "special":
            f = to_float32(random_values(rng, n, dtype), dtype)
            big = 65504.0 if dtype.value == F16 else 3.0e38
            specials = np.array([np.nan, -np.nan, np.inf, -np.inf, big, -big, 1e-40, -1e-40, -0.0, 0.0], np.float32)
            payload = np.array([0x7FA00001, 0xFF800003], dtype=np.uint32).view(np.float32)
            where = rng.random(n) < 0.1
            f[where] = rng.choice(np.concatenate([specials, payload]), size=int(where.sum()))
            a = from_float32(f, dtype, canonical_nan=False)  # the NaN payloads are the point
        else:  # normal
            a = random_values(rng, n, dtype)
        out.append(a)
    return out


def buffers(spec, count, dtype, inputs, x_off=None, out_off=None):
    """Inputs copied to cuda:0 and poisoned outputs; ``x_off``/``out_off``: per-rank storage
    offsets in elements (views into a larger tensor: misaligned for 16-byte vectors)."""
    import torch
    R = spec.world_size
    x_off = x_off or [0] * R
    out_off = out_off or [0] * R
    dt = torch_dtype(dtype)
    xs, outs = [], []
    for r in range(R):
        n_in, n_out = len(spec.inputs[r]) * count, len(spec.outputs[r]) * count
        if len(spec.inputs[r]):
            base = torch.empty(n_in + x_off[r], dtype=dt, device=f"cuda:{DEVICE}")
            x = base[x_off[r]:x_off[r] + n_in]
            if n_in:
                x.copy_(to_dev(inputs[r], dtype))
            xs.append(x)
        else:
            xs.append(None)
        if len(spec.outputs[r]):
            base = torch.empty(n_out + out_off[r], dtype=dt, device=f"cuda:{DEVICE}")
            o = base[out_off[r]:out_off[r] + n_out]
            poison(o)
            outs.append(o)
        else:
            outs.append(None)
    torch.cuda.synchronize(DEVICE)
    return xs, outs


def reference(spec, inputs, count, dtype, op="sum"):
    from purlinc.frontend.evaluate import evaluate
    return evaluate(spec, inputs, count, dtype, op if spec.is_reduce else None)


def runs_for(coll, count, itemsize):
    """Rank 0's Collective that a call of ``count`` runs (a plain load's bucket)."""
    rank = coll[0]
    return rank.variant_for(count, itemsize) if hasattr(rank, "variant_for") else rank


def simulated(coll, spec, inputs, count, dtype, op):
    """The SNAC simulator of the schedule that ran, cut in the pieces its staging cuts the call
    into: what the docs promise the GPU matches bit for bit (NaN payloads aside)."""
    from purlinc.runtime.validate import choose_piece
    from purlinc.snac.simulate import simulate
    runs = runs_for(coll, count, dtype.itemsize)
    piece = choose_piece(count, runs.layout.staging, dtype.itemsize)
    return simulate(runs.compiled.schedule, spec, inputs, count, dtype, op, calls=1, piece=piece)


def on_streams(streams, work):
    """``work()`` with every stream of ``streams`` ordered after the current stream and the
    current stream after them, then the device synchronized (a raise included)."""
    import torch
    cur = torch.cuda.current_stream(DEVICE)
    for s in streams:
        s.wait_stream(cur)
    try:
        return work()
    finally:
        for s in streams:
            cur.wait_stream(s)
        torch.cuda.synchronize(DEVICE)


def issue_group_calls(calls, streams) -> None:
    """Each (collective, xs, outs, ...) of ``calls`` called in order on ``streams``, nothing between."""
    for coll, xs, outs, *_ in calls:
        coll(xs, outs, streams=streams)


def gcall(coll, g, xs, outs, op="sum", streams="rank", **kw):
    """One group call, every rank on its own stream ordered after (and before) the current
    stream; the device synchronized and the collective's error record checked."""
    st = g.streams if isinstance(streams, str) and streams == "rank" else streams
    result = on_streams(st or (), lambda: coll(xs, outs, op=op, streams=st, **kw))
    coll.check()
    return result


def refused(call, outs=(), kinds=None, must=None, accept=None):
    """``call()`` must raise one of ``kinds`` (default ArgumentError) before launching anything
    (every tensor in ``outs`` still poisoned), its message matching the regex ``must``.  If it
    is accepted instead, ``accept()`` (when given) must confirm a correct result."""
    import torch
    from purlinc.runtime.errors import ArgumentError
    kinds = kinds or (ArgumentError,)
    try:
        call()
    except kinds as error:
        torch.cuda.synchronize(DEVICE)
        text = first_line(error)
        touched = [r for r, o in enumerate(outs) if o is not None and not still_poisoned(o)]
        if touched:
            raise Unexpected(f"{type(error).__name__} raised, but outputs of rank(s) {touched} were written: {text}")
        if must and not re.search(must, full_text(error), re.I):
            raise Unexpected(f"{type(error).__name__} does not say /{must}/: {text}")
        return f"refused: {type(error).__name__}: {text}"
    torch.cuda.synchronize(DEVICE)
    if accept is None:
        raise Unexpected("accepted without an error")
    accept()
    return "accepted, result correct"


# ==========================================================================================
# the child's state: loopback groups and loaded collectives, made on first use

class Env:
    def __init__(self):
        self.groups: dict = {}
        self.loads: dict = {}
        self.state: dict = {}

    def group(self, R: int):
        g = self.groups.get(R)
        if g is not None and any(getattr(c, "failed", None) is not None or getattr(c, "closed", False)
                                 for c in g.comms):
            self.drop(R)
            g = None
        if g is None:
            g = new_group(R)
            self.groups[R] = g
        return g

    def drop(self, R: int) -> None:
        for key in [k for k in self.loads if k[0] == R]:
            self.loads.pop(key)
        g = self.groups.pop(R, None)
        if g is not None:
            try:
                g.close()
            except Exception:  # noqa: BLE001 - a failed group still gives its memory back
                pass

    def refresh(self) -> None:
        """Drop every group a timeout stopped (a fresh one is made on next use)."""
        for R, g in list(self.groups.items()):
            if any(getattr(c, "failed", None) is not None for c in g.comms):
                self.drop(R)

    def load(self, R: int, name: str, mode: str = "pinned", stage_mb=None, tag: str = "", params=None, **over):
        g = self.group(R)
        key = (R, name, mode, stage_mb, tag, tuple(sorted((params or {}).items())), tuple(sorted(over.items())))
        coll = self.loads.get(key)
        if coll is None:
            coll = load_on(g, name, mode, stage_mb, params=params, **over)
            self.loads[key] = coll
        return coll, g


def new_group(R: int):
    import torch
    import purlinc
    g = purlinc.LocalGroup([DEVICE] * R, share_devices=True)
    g.streams = [torch.cuda.Stream(device=DEVICE) for _ in range(R)]
    return g


def load_on(g, name: str, mode: str = "pinned", stage_mb=None, params=None, **over):
    """``purlinc.load`` on the group: mode 'tuned' is the plain load (no options), 'pinned'
    the direct-push / ldst / 2-channel schedule (``over`` replaces any of those options)."""
    import purlinc
    old = os.environ.get("PURLIN_STAGE_MB")
    if stage_mb is not None:
        os.environ["PURLIN_STAGE_MB"] = str(stage_mb)
    try:
        if mode == "tuned":
            return purlinc.load(EX / name, g, params=params)
        return purlinc.load(EX / name, g, params=params, **{**PIN, **over})
    finally:
        if stage_mb is not None:
            if old is None:
                os.environ.pop("PURLIN_STAGE_MB", None)
            else:
                os.environ["PURLIN_STAGE_MB"] = old


def gpu_healthy() -> bool:
    try:
        import torch
        torch.cuda.synchronize(DEVICE)
        t = torch.ones(16, device=f"cuda:{DEVICE}")
        return float((t + 1).sum().item()) == 32.0
    except Exception:  # noqa: BLE001
        return False


# ==========================================================================================
# the cases

# The pinned kernels (R, collective, dtypes, ops) and the tuned loads the probe uses: compiled
# in parallel by the first case, so no case waits for NVRTC one kernel at a time.
COUNT_MATRIX = (
    ("allreduce.pln", (F32, BF16, F16, I32)),
    ("allgather.pln", (F32, BF16, F16, I32)),
    ("reduce_scatter.pln", (F32, BF16)),
    ("alltoall.pln", (F32, BF16)),
    ("broadcast.pln", (F32,)),
)
PINNED_KERNELS = (  # (R, collective, dtypes, ops, params, option overrides)
    *[(R, name, dtypes, ("sum",), None, {}) for R in (2, 4) for name, dtypes in COUNT_MATRIX],
    *[(3, name, (F32,), ("sum",), None, {}) for name, _ in COUNT_MATRIX],
    *[(R, "allreduce.pln", (F32, I32), ("prod", "max", "min"), None, {}) for R in (2, 4)],
    (3, "allreduce.pln", (F32,), ("max",), None, {}),
    (4, "reduce_scatter.pln", (F32,), ("max", "min"), None, {}),
    (4, "broadcast.pln", (F32, BF16), ("sum",), {"root": 3}, {}),
    (4, "allreduce.pln", (F32,), ("sum",), None, {"channels": 512}),
)
PINNED_TWINS = ((4, "allreduce.pln", F32), (2, "allreduce.pln", F32), (2, "allgather.pln", BF16))
TUNED_KERNELS = ((2, "allreduce.pln", F32, True), (4, "allreduce.pln", F32, False),
                 (2, "allgather.pln", BF16, False), (4, "allgather.pln", BF16, True), (3, "allreduce.pln", F32, False))


def c_precompile(env):
    from purlinc.concurrent import compile_jobs
    from purlinc.runtime import driver, residency
    from purlinc.runtime.collective import prepare
    from purlinc.runtime.tuned import prepare_tuned
    from purlinc.runtime.zerocopy import twin_compiled
    arch = driver.arch_of(DEVICE)
    jobs, problems = [], []
    for R, name, dtypes, ops, params, over in PINNED_KERNELS:
        try:
            c = prepare(EX / name, R, arch=arch, params=params, **{**PIN, **over})
        except Exception as error:  # noqa: BLE001
            problems.append(f"prepare {name} R={R}: {type(error).__name__}: {first_line(error)}")
            continue
        jobs += [(c, dt, op) for dt in dtypes for op in ops]
    for R, name, dt in PINNED_TWINS:
        try:
            twin = twin_compiled(prepare(EX / name, R, arch=arch, **PIN))
            if twin is not None:
                jobs.append((twin, dt, "sum"))
        except Exception as error:  # noqa: BLE001
            problems.append(f"twin {name} R={R}: {type(error).__name__}: {first_line(error)}")
    for R, name, dt, twins in TUNED_KERNELS:
        try:
            cap = residency.max_channels([DEVICE] * R, driver.sm_count)
            prepared, _ = prepare_tuned(EX / name, R, arch=arch, max_channels=cap)
            for p in prepared:
                if p.compiled.plan is None:
                    jobs.append((p.compiled, dt, "sum"))
                    if twins and not p.compiled.options.packed:
                        twin = twin_compiled(p.compiled)
                        if twin is not None:
                            jobs.append((twin, dt, "sum"))
        except Exception as error:  # noqa: BLE001
            problems.append(f"tuned {name} R={R}: {type(error).__name__}: {first_line(error)}")
    distinct = len({(id(c), dt, op if c.schedule.operation.value == "reduce" else None) for c, dt, op in jobs})
    try:
        compile_jobs(jobs)
    except Exception as error:  # noqa: BLE001 - raised after every compile ended
        problems.append(f"compile: {type(error).__name__}: {first_line(error)}")
    if problems:
        raise Unexpected("; ".join(problems)[:1500])
    return f"{distinct} kernels ready ({arch})"


def c_count(R, name, dt, count, params=None):
    def run(env):
        coll, g = env.load(R, name, params=params)
        spec, dtype = coll[0].compiled.spec, dtype_of(dt)
        rng = _np().random.default_rng(count * 31 + R)
        inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
        xs, outs = buffers(spec, count, dtype, inputs)
        gcall(coll, g, xs, outs)
        compare(outs, reference(spec, inputs, count, dtype), dtype)
        return "ok"
    return run


def _boundary_counts(coll, itemsize):
    """Counts (elements per chunk) at the staging edges of rank 0's schedule: the largest call
    the small region takes, the largest that runs in one round, and one past each."""
    from purlinc.atom.abi import slice_step
    st = coll[0].layout.staging

    def most(limit):
        n = max(1, limit * st.slices // itemsize)
        while n > 1 and slice_step(n * itemsize, st.slices) > limit:
            n -= 1
        while slice_step((n + 1) * itemsize, st.slices) <= limit:
            n += 1
        return n

    small = most(st.step_of(st.small)) if st.small else None
    large = most(st.largest_step)
    return small, large, st


BOUNDARY_POINTS = ("small_region_max", "small_region_max+1", "one_round_max", "one_round_max+1",
                   "three_rounds_odd", "chunk_4MiB+4B", "one_round_max+1_misaligned")


def c_selfcheck(env):
    """The probe's own checks must be able to fail: a poisoned (unwritten) output, one changed
    element, a NaN in the wrong place, a written tensor taken for untouched."""
    import torch
    np = _np()
    problems = []

    def must_fail(what, fn):
        try:
            fn()
        except Unexpected:
            return
        problems.append(f"{what} passed")

    for dt in (F32, BF16, F16, I32):
        dtype = dtype_of(dt)
        want = [np.asarray(make_inputs(type("S", (), {"world_size": 1, "inputs": [[0]]})(), 64, dtype,
                                       np.random.default_rng(1), "int")[0])]
        good = to_dev(want[0], dtype)
        try:
            compare([good], want, dtype)
        except Unexpected as error:
            problems.append(f"{dt}: an exact copy failed: {error}")
        changed = good.clone()
        changed[17] = changed[17] + 1
        must_fail(f"{dt}: one changed element", lambda: compare([changed], want, dtype))
        unwritten = torch.empty_like(good)
        poison(unwritten)
        must_fail(f"{dt}: an unwritten (poisoned) output", lambda: compare([unwritten], want, dtype))
        if not still_poisoned(unwritten) or still_poisoned(good):
            problems.append(f"{dt}: still_poisoned is wrong")
    dtype = dtype_of(F32)
    want = [np.array([np.nan, 1.0, -0.0], np.float32)]
    must_fail("NaN moved", lambda: compare([to_dev(np.array([1.0, np.nan, -0.0], np.float32), dtype)], want, dtype,
                                           nan_ok=True))
    must_fail("-0 for +0", lambda: compare([to_dev(np.array([np.nan, 1.0, 0.0], np.float32), dtype)], want, dtype,
                                           nan_ok=True))
    other_nan = np.array([0x7FA00001], np.uint32).view(np.float32)[0]
    try:
        compare([to_dev(np.array([other_nan, 1.0, -0.0], np.float32), dtype)], want, dtype, nan_ok=True)
    except Unexpected as error:
        problems.append(f"a NaN with another payload failed with nan_ok: {error}")
    if problems:
        raise Unexpected("the probe's checks are broken: " + "; ".join(problems))
    return "ok (compare/poison checks detect unwritten, changed and misplaced elements)"


def c_param_errors(which):
    def run(env):
        from purlinc.errors import PurlinError
        g = env.group(4)
        params = {"root": 4} if which == "root_out_of_range" else {"bogus": 1}
        return refused(lambda: load_on(g, "broadcast.pln", params=params), (), kinds=(PurlinError,),
                       must=r"root|bogus|param")
    return run


def c_residency(env):
    """Pinned channels=512 at R=4 on one GPU: 2,048 blocks that must all be resident at once."""
    from purlinc.runtime.errors import ArgumentError
    coll, g = env.load(4, "allreduce.pln", channels=512)
    spec, dtype, count = coll[0].compiled.spec, dtype_of(F32), 100003
    inputs = make_inputs(spec, count, dtype, _np().random.default_rng(61), "int")
    xs, outs = buffers(spec, count, dtype, inputs)
    want = reference(spec, inputs, count, dtype)
    return refused(lambda: gcall(coll, g, xs, outs), outs, kinds=(ArgumentError,), must=r"resident|block",
                   accept=lambda: compare(outs, want, dtype))


def c_zerocopy(which):
    """Buffers from the symmetric heap (group.empty): the zero-copy (registered) schedules,
    also on views of heap tensors at odd element offsets."""
    def run(env):
        import torch
        from purlinc.runtime.errors import ArgumentError, MismatchError
        name, dt = ("allgather.pln", BF16) if which == "allgather_bf16_heap" else ("allreduce.pln", F32)
        coll, g = env.load(2, name)
        spec, dtype, count = coll[0].compiled.spec, dtype_of(dt), 4099
        tdt = torch_dtype(dtype)
        inputs = make_inputs(spec, count, dtype, _np().random.default_rng(67), "int" if spec.is_reduce else "bits")
        want = reference(spec, inputs, count, dtype)
        n_in, n_out = len(spec.inputs[0]) * count, len(spec.outputs[0]) * count
        xo, oo = {"x_view_+1": (1, 0), "x+3_out+1_views": (3, 1)}.get(which, (0, 0))
        hx = g.empty((n_in + 4,), tdt)
        ho = g.empty((n_out + 4,), tdt)
        xs = [t[xo:xo + n_in] for t in hx]
        outs = [t[oo:oo + n_out] for t in ho]
        if which == "heap_on_rank0_only":
            xs[1] = torch.empty(n_in, dtype=tdt, device=f"cuda:{DEVICE}")
            outs[1] = torch.empty(n_out, dtype=tdt, device=f"cuda:{DEVICE}")
        if which == "views_at_different_offsets_per_rank":
            xs[1] = hx[1][2:2 + n_in]
        for r in range(2):
            xs[r].copy_(to_dev(inputs[r], dtype))
            poison(outs[r])
        torch.cuda.synchronize(DEVICE)
        zc = getattr(coll[0], "_zc", None)
        before = len(zc.offsets) if zc is not None else 0
        try:
            if which in ("heap_on_rank0_only", "views_at_different_offsets_per_rank"):
                return refused(lambda: gcall(coll, g, xs, outs), outs, kinds=(MismatchError, ArgumentError),
                               accept=lambda: compare(outs, want, dtype))
            gcall(coll, g, xs, outs)
            compare(outs, want, dtype)
            took = zc is not None and len(zc.offsets) > before
            return f"ok ({'zero-copy path' if took else 'staged'})"
        finally:
            xs = outs = hx = ho = None  # the heap blocks go back once no tensor holds them
            torch.cuda.synchronize(DEVICE)
    return run


def c_concurrent_streams(env):
    """An all-reduce and an all-gather of the same group issued on two sets of rank streams
    with nothing ordering them (every rank issues them in the same order), ten times."""
    import torch
    ar, g = env.load(4, "allreduce.pln")
    ag, _ = env.load(4, "allgather.pln")
    second = [torch.cuda.Stream(device=DEVICE) for _ in range(4)]
    rng = _np().random.default_rng(71)
    dtype = dtype_of(F32)
    calls = []
    for i in range(10):
        for coll, streams in ((ar, g.streams), (ag, second)):
            spec = coll[0].compiled.spec
            count = (4097, 100003)[i % 2]
            inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
            xs, outs = buffers(spec, count, dtype, inputs)
            calls.append((coll, streams, xs, outs, reference(spec, inputs, count, dtype)))
    def issue():
        for coll, streams, xs, outs, _ in calls:
            coll(xs, outs, streams=streams)
    on_streams((*g.streams, *second), issue)
    ar.check()
    ag.check()
    for i, (coll, _, _, outs, want) in enumerate(calls):
        compare(outs, want, dtype, f" (call {i}, {coll.name})")
    return "ok (20 calls on two stream sets, all correct)"


def c_boundary(name, dt, point):
    def run(env):
        from purlinc.runtime.validate import choose_piece
        coll, g = env.load(2, name, stage_mb=4)
        spec, dtype = coll[0].compiled.spec, dtype_of(dt)
        small, large, st = _boundary_counts(coll, dtype.itemsize)
        counts = {"small_region_max": small, "small_region_max+1": None if small is None else small + 1,
                  "one_round_max": large, "one_round_max+1": large + 1, "three_rounds_odd": 2 * large + 3,
                  "chunk_4MiB+4B": (4 * 2**20 + 4) // dtype.itemsize, "one_round_max+1_misaligned": large + 1}
        count = counts[point]
        if count is None:
            return "n/a: this staging has no small region"
        off = point.endswith("misaligned")
        rng = _np().random.default_rng(count)
        inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
        xs, outs = buffers(spec, count, dtype, inputs, x_off=[1, 3] if off else None, out_off=[3, 1] if off else None)
        gcall(coll, g, xs, outs)
        compare(outs, reference(spec, inputs, count, dtype), dtype)
        piece = choose_piece(count, st, dtype.itemsize)
        return f"ok (count {count}, piece {piece}, {-(-count // piece)} round(s); staging {st})"
    return run


def c_tuned_edges(R):
    def run(env):
        from purlinc.runtime import tuning
        coll, g = env.load(R, "allreduce.pln", "tuned")
        spec, dtype = coll[0].compiled.spec, dtype_of(F32)
        tuned = coll[0]
        failures, done = [], []
        for b, bucket in enumerate(tuned.buckets):
            if bucket.max_bytes is None:
                continue
            edge = max(1, bucket.max_bytes // (dtype.itemsize * tuned.units))
            for count in (edge, edge + 1):
                which = tuning.choose(tuned.buckets, count * dtype.itemsize * tuned.units)
                rng = _np().random.default_rng(count)
                inputs = make_inputs(spec, count, dtype, rng, "int")
                xs, outs = buffers(spec, count, dtype, inputs)
                try:
                    gcall(coll, g, xs, outs)
                    compare(outs, reference(spec, inputs, count, dtype), dtype)
                    done.append(f"n={count}->b{which}")
                except Unexpected as error:
                    failures.append(f"n={count} (bucket {which}, {tuned.variants[which].compiled.options.key()}): {error}")
        if failures:
            raise Unexpected(" | ".join(failures)[:1500])
        return "ok: " + ", ".join(done)
    return run


ALIGN_TARGETS = (("pinned", "allreduce.pln", F32, 4099), ("pinned", "allreduce.pln", BF16, 4099),
                 ("pinned", "allgather.pln", BF16, 4099), ("pinned", "alltoall.pln", F32, 4099),
                 ("tuned", "allreduce.pln", F32, 1001), ("tuned", "allreduce.pln", F32, 300001))
ALIGN_OFFSETS = (("x+1", [1, 1], [0, 0]), ("out+1", [0, 0], [1, 1]), ("x+3,out+2", [3, 3], [2, 2]),
                 ("per-rank x+1/+3,out+2/+0", [1, 3], [2, 0]))


def c_align(mode, name, dt, count, xo, oo):
    def run(env):
        coll, g = env.load(2, name, mode)
        spec, dtype = coll[0].compiled.spec, dtype_of(dt)
        rng = _np().random.default_rng(count + sum(xo) * 7 + sum(oo))
        inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
        xs, outs = buffers(spec, count, dtype, inputs, x_off=xo, out_off=oo)
        want = reference(spec, inputs, count, dtype)
        return refused(lambda: gcall(coll, g, xs, outs), outs,
                       accept=lambda: compare(outs, want, dtype))
    return run


def _cupy():
    """CuPy, for the cases that pass its arrays; without it such a case is skipped (a Note),
    not failed: CuPy is optional."""
    try:
        import cupy
    except Exception:  # noqa: BLE001
        raise Note("skipped: cupy is not importable") from None
    return cupy


def c_cupy_misaligned(env):
    cupy = _cupy()
    coll, g = env.load(2, "allreduce.pln")
    spec, dtype, count = coll[0].compiled.spec, dtype_of(F32), 1024
    inputs = make_inputs(spec, count, dtype, _np().random.default_rng(5), "int")
    xs, outs = buffers(spec, count, dtype, inputs)
    with cupy.cuda.Device(DEVICE):
        raw = cupy.zeros(2 * count * 4 + 16, dtype=cupy.uint8)
        odd = cupy.ndarray((2 * count,), dtype=cupy.float32, memptr=raw.data + 1)  # 1 byte off
    cupy.cuda.Device(DEVICE).synchronize()
    return refused(lambda: gcall(coll, g, [odd, xs[1]], outs), outs, must=r"\bx\b.*align|align.*\bx\b")


def c_cupy_inputs(env):
    cupy = _cupy()
    coll, g = env.load(2, "allreduce.pln")
    spec, dtype, count = coll[0].compiled.spec, dtype_of(F32), 4097
    inputs = make_inputs(spec, count, dtype, _np().random.default_rng(6), "int")
    with cupy.cuda.Device(DEVICE):
        xs = [cupy.asarray(a) for a in inputs]
    cupy.cuda.Device(DEVICE).synchronize()
    _, outs = buffers(spec, count, dtype, inputs)
    gcall(coll, g, xs, outs)
    compare(outs, reference(spec, inputs, count, dtype), dtype)
    return "ok (CuPy inputs, torch outputs)"


def _ar2(env, count=1024, dt=F32, seed=0):
    """The pinned R=2 all-reduce, inputs, buffers and the reference."""
    coll, g = env.load(2, "allreduce.pln")
    spec, dtype = coll[0].compiled.spec, dtype_of(dt)
    inputs = make_inputs(spec, count, dtype, _np().random.default_rng(seed), "int")
    xs, outs = buffers(spec, count, dtype, inputs)
    return coll, g, spec, dtype, inputs, xs, outs, reference(spec, inputs, count, dtype)


def c_noncontig(which):
    def run(env):
        import torch
        count = 1024
        coll, g, spec, dtype, inputs, xs, outs, want = _ar2(env, count, seed=11)
        n = 2 * count
        dev = f"cuda:{DEVICE}"
        if which == "x_transposed":
            t = torch.empty(count, 2, device=dev).t()  # (2, count), strides (1, 2)
            t.copy_(xs[0].view(2, count))
            xs[0], must = t, r"\bx\b.*contiguous"
        elif which == "x_strided_slice":
            t = torch.empty(2 * n, device=dev)[::2]
            t.copy_(xs[0])
            xs[0], must = t, r"\bx\b.*contiguous"
        elif which == "x_expanded_stride0":
            xs[0], must = torch.ones(1, device=dev).expand(n), r"\bx\b.*contiguous"
            inputs[0] = _np().ones(n, dtype=_np().float32)
            want = reference(spec, inputs, count, dtype)
        elif which == "out_transposed":
            t = torch.empty(count, 2, device=dev).t()
            poison(t)
            outs[0], must = t, r"\bout\b.*contiguous"
        elif which == "out_strided_slice":
            t = torch.empty(2 * n, device=dev)[::2]
            poison(t)
            outs[0], must = t, r"\bout\b.*contiguous"
        elif which == "x_out_2d_contiguous":
            xs = [x.view(2, count) for x in xs]
            outs = [o.view(2, count) for o in outs]
            gcall(coll, g, xs, outs)
            compare(outs, want, dtype)
            return "ok (2-D contiguous tensors)"
        else:
            raise ValueError(which)
        torch.cuda.synchronize(DEVICE)
        return refused(lambda: gcall(coll, g, xs, outs), outs, must=must, accept=lambda: compare(outs, want, dtype))
    return run


def c_overlap(which):
    def run(env):
        import torch
        count = 1024
        coll, g, spec, dtype, inputs, xs, outs, want = _ar2(env, count, seed=13)
        n = 2 * count
        dev = f"cuda:{DEVICE}"
        if which == "inplace_all_ranks":
            saved = [x.clone() for x in xs]

            def untouched():
                torch.cuda.synchronize(DEVICE)
                return all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(xs, saved))
            result = refused(lambda: gcall(coll, g, xs, xs), (), must=r"overlap|in-place",
                             accept=lambda: compare(xs, want, dtype))
            if result.startswith("refused") and not untouched():
                raise Unexpected("refused, but the input/output tensors were written")
            return result
        if which == "inplace_rank0_only":
            outs[0] = xs[0]
            return refused(lambda: gcall(coll, g, xs, outs), [outs[1]], must=r"overlap|in-place",
                           accept=lambda: compare(outs, want, dtype))
        if which == "partial_overlap":
            base = torch.empty(n + n // 2, device=dev)
            base[:n].copy_(xs[0])
            xs[0], outs[0] = base[:n], base[n // 2:n // 2 + n]
            return refused(lambda: gcall(coll, g, xs, outs), [outs[1]], must=r"overlap",
                           accept=lambda: compare(outs, want, dtype))
        if which == "adjacent_no_overlap":
            base = torch.empty(2 * n, device=dev)
            base[:n].copy_(xs[0])
            poison(base[n:])
            xs[0], outs[0] = base[:n], base[n:]
            gcall(coll, g, xs, outs)
            compare(outs, want, dtype)
            return "ok (x and out adjacent in one allocation)"
        if which == "allgather_output_slot_as_input":
            ag, g2 = env.load(2, "allgather.pln")
            spec2, dtype2 = ag[0].compiled.spec, dtype_of(F32)
            ins = make_inputs(spec2, count, dtype2, _np().random.default_rng(17), "bits")
            want2 = reference(spec2, ins, count, dtype2)
            outs2 = [torch.empty(2 * count, device=dev) for _ in range(2)]
            xs2 = []
            for r in range(2):
                poison(outs2[r])
                slot = outs2[r][r * count:(r + 1) * count]
                slot.copy_(to_dev(ins[r], dtype2))
                xs2.append(slot)
            torch.cuda.synchronize(DEVICE)
            try:
                gcall(ag, g2, xs2, outs2)
            except Exception as error:  # noqa: BLE001
                from purlinc.runtime.errors import ArgumentError
                if isinstance(error, ArgumentError) and re.search(r"overlap|in-place", full_text(error), re.I):
                    return f"refused: {type(error).__name__}: {first_line(error)}"
                raise
            compare(outs2, want2, dtype2)
            return "accepted, result correct"
        if which == "cross_rank_alias":
            outs[0] = xs[1]  # rank 0 writes where rank 1 reads: no per-rank overlap
            try:
                gcall(coll, g, xs, outs)
            except Exception as error:  # noqa: BLE001
                from purlinc.runtime.errors import ArgumentError
                if isinstance(error, ArgumentError):
                    return f"refused: {type(error).__name__}: {first_line(error)}"
                raise
            try:
                compare(outs, want, dtype)
            except Unexpected as error:
                raise Note(f"accepted, and the result is not the all-reduce (no document defines it): {error}")
            return "accepted, result correct"
        raise ValueError(which)
    return run


def c_wrong(which):
    def run(env):
        import torch
        from purlinc.runtime.errors import ArgumentError, MismatchError
        count = 1024
        coll, g, spec, dtype, inputs, xs, outs, want = _ar2(env, count, seed=19)
        n = 2 * count
        dev = f"cuda:{DEVICE}"
        call = lambda: gcall(coll, g, xs, outs)  # noqa: E731
        kinds, must = (ArgumentError,), None
        if which == "out_too_small":
            outs[0] = torch.empty(n - 1, device=dev)
            poison(outs[0])
            must = r"\bout\b"
        elif which == "out_too_large":
            outs[0] = torch.empty(n + 1, device=dev)
            poison(outs[0])
            must = r"\bout\b"
        elif which == "x_not_a_multiple_of_R":
            xs = [torch.zeros(n - 1, device=dev) for _ in range(2)]
            must = r"\bx\b"
        elif which == "counts_differ_between_ranks":
            xs[1] = torch.zeros(n + 2, device=dev)
            outs[1] = torch.empty(n + 2, device=dev)
            poison(outs[1])
            kinds, must = (MismatchError,), r"count"
        elif which == "out_dtype_differs_from_x":
            outs[0] = torch.empty(n, device=dev, dtype=torch.bfloat16)
            poison(outs[0])
            must = r"\bout\b.*dtype|dtype.*\bout\b"
        elif which == "dtypes_differ_between_ranks":
            xs[1] = xs[1].to(torch.bfloat16)
            outs[1] = torch.empty(n, device=dev, dtype=torch.bfloat16)
            poison(outs[1])
            kinds, must = (MismatchError,), r"dtype"
        elif which == "x_on_cpu":
            xs[0] = xs[0].cpu()
            must = r"\bx\b.*(host|cpu|device)"
        elif which == "out_on_cpu":
            outs[0] = torch.empty(n)
            poison(outs[0])
            must = r"\bout\b.*(host|cpu|device)"
        elif which == "x_float64":
            xs[0] = xs[0].double()
            must = r"\bx\b.*float64|float64"
        elif which == "x_none_on_a_rank_that_gives":
            xs[0] = None
            must = r"\bx\b.*required"
        elif which == "xs_has_R-1_entries":
            call = lambda: gcall(coll, g, xs[:1], outs)  # noqa: E731
            must = r"\bxs\b"
        elif which == "xs_is_one_tensor":
            stacked = torch.stack(xs)
            call = lambda: gcall(coll, g, stacked, outs)  # noqa: E731
            must = r"\bxs\b"
        elif which == "one_stream_for_every_rank":
            one = g.streams[0]
            call = lambda: gcall(coll, g, xs, outs, streams=[one] * 2)  # noqa: E731
            must = r"stream"
        elif which == "no_streams":
            call = lambda: gcall(coll, g, xs, outs, streams=None)  # noqa: E731
            must = r"stream"
        elif which == "count_kwarg_disagrees":
            call = lambda: gcall(coll, g, xs, outs, count=count + 1)  # noqa: E731
            must = r"count"
        elif which == "count_kwarg_is_a_str":
            call = lambda: gcall(coll, g, xs, outs, count=str(count))  # noqa: E731
            must = r"count"
        elif which == "unknown_op":
            call = lambda: gcall(coll, g, xs, outs, op="bogus")  # noqa: E731
            must = r"op|bogus"
        elif which == "broadcast_non_root_passes_x":
            bc, gb = env.load(2, "broadcast.pln")
            spec_b = bc[0].compiled.spec
            ins = make_inputs(spec_b, count, dtype, _np().random.default_rng(23), "bits")
            xb, ob = buffers(spec_b, count, dtype, ins)
            xb[1] = torch.zeros(count, device=dev)
            return refused(lambda: gcall(bc, gb, xb, ob), ob, must=r"no input|\bx\b")
        elif which == "outs_none_allocates":
            result = gcall(coll, g, xs, None)
            compare(result, want, dtype)
            return "ok (outputs allocated, results correct)"
        elif which == "correct_call_after_refusals":
            gcall(coll, g, xs, outs)
            compare(outs, want, dtype)
            return "ok"
        else:
            raise ValueError(which)
        torch.cuda.synchronize(DEVICE)
        return refused(call, outs, kinds=kinds, must=must)
    return run


OPS_ROWS = (
    *[(F32, op, "special") for op in ("sum", "prod", "max", "min")],
    (BF16, "sum", "special"), (F16, "sum", "special"),
    *[(I32, op, "i32full") for op in ("sum", "prod", "max", "min")],
    *[(F32, op, "negzero") for op in ("sum", "max", "min")],
    (F32, "MAX", "normal"),
)


def c_op(dt, op, kind, name="allreduce.pln", R=4, count=4097):
    def run(env):
        coll, g = env.load(R, name)
        spec, dtype = coll[0].compiled.spec, dtype_of(dt)
        rng = _np().random.default_rng(zlib.crc32(f"{dt}/{op}/{kind}/{name}".encode()))
        inputs = make_inputs(spec, count, dtype, rng, kind)
        xs, outs = buffers(spec, count, dtype, inputs)
        from purlinc.runtime.errors import ArgumentError
        try:
            gcall(coll, g, xs, outs, op=op)
        except ArgumentError as error:
            if op != op.lower():
                return f"refused (case-sensitive op names): {first_line(error)}"
            raise
        ref = reference(spec, inputs, count, dtype, op.lower())
        if dtype.value == I32 or kind == "negzero":
            compare(outs, ref, dtype, " vs evaluate")  # order-independent: bit for bit
            if kind == "negzero":
                np = _np()
                bad = [r for r, o in enumerate(outs) if o is not None and
                       not (bits_np(o) == bits_of(_np().array([-0.0], np.float32))[0]).all()]
                if bad:
                    raise Unexpected(f"ranks {bad}: some outputs are not -0.0")
            detail = "bit for bit vs evaluate"
        else:
            compare(outs, simulated(coll, spec, inputs, count, dtype, op.lower()), dtype, " vs simulator", nan_ok=True)
            detail = "bit for bit vs the simulator (NaN payloads aside)"
            try:
                compare(outs, ref, dtype, " vs evaluate", nan_ok=True)
                detail += "; equals evaluate too"
            except Unexpected as error:
                detail += f"; differs from evaluate's rank-order result (allowed: another order): {str(error)[:200]}"
        if name == "allreduce.pln":
            same_across_ranks(outs, dtype)
        return "ok: " + detail
    return run


def c_avg(env):
    coll, g, spec, dtype, inputs, xs, outs, want = _ar2(env, 1024, seed=29)
    return refused(lambda: gcall(coll, g, xs, outs, op="avg"), outs, must=r"avg|op")


def c_b2b_pinned(env):
    """1000 group calls of the pinned R=2 all-reduce, counts and dtypes alternating, no host
    synchronisation between them, a rank delayed at random now and then; then every output."""
    import torch
    np = _np()
    coll, g = env.load(2, "allreduce.pln")
    spec = coll[0].compiled.spec
    combos = ((4096, F32), (7, BF16), (65537, I32), (1, F32), (2048, BF16), (3, I32), (100003, F32), (64, F16))
    rng = np.random.default_rng(1000)
    sets = []
    for count, dt in combos:
        dtype = dtype_of(dt)
        inputs = make_inputs(spec, count, dtype, rng, "int")
        xs, _ = buffers(spec, count, dtype, inputs, )
        want = [to_dev(w, dtype) for w in reference(spec, inputs, count, dtype)]
        sets.append((count, dtype, xs, want))
    calls = 1000
    outs_all = []
    for i in range(calls):
        count, dtype, xs, _ = sets[i % len(sets)]
        outs = [torch.empty(2 * count, dtype=torch_dtype(dtype), device=f"cuda:{DEVICE}") for _ in range(2)]
        for o in outs:
            poison(o)
        outs_all.append(outs)
    cur = torch.cuda.current_stream(DEVICE)
    torch.cuda.synchronize(DEVICE)
    for s in g.streams:
        s.wait_stream(cur)
    delays = rng.integers(0, 200_000, calls)
    sleep = getattr(torch.cuda, "_sleep", None)
    t0 = time.time()
    for i in range(calls):
        count, dtype, xs, _ = sets[i % len(sets)]
        if sleep is not None and i % 37 == 0:
            with torch.cuda.stream(g.streams[i % 2]):
                sleep(int(delays[i]))
        coll(xs, outs_all[i], streams=g.streams)
    issued = time.time() - t0
    for s in g.streams:
        cur.wait_stream(s)
    torch.cuda.synchronize(DEVICE)
    coll.check()
    bad = []
    for i in range(calls):
        count, dtype, xs, want = sets[i % len(sets)]
        for r in range(2):
            a, b = outs_all[i][r], want[r]
            signed = {2: torch.int16, 4: torch.int32}[a.element_size()]
            if not torch.equal(a.view(signed), b.view(signed)):
                bad.append((i, r, count, dtype.value))
    if bad:
        i, r, count, dt = bad[0]
        got, exp = bits_np(outs_all[i][r]), bits_np(sets[i % len(sets)][3][r])
        idx = np.flatnonzero(got != exp)
        raise Unexpected(f"wrong result in {len(bad)} of {2 * calls} rank outputs; first: call {i} rank {r} "
                         f"(count {count}, {dt}): {idx.size} elements differ, first at {idx[:5].tolist()}: "
                         f"got {shown(got, dtype_of(dt), idx[:5])}, want {shown(exp, dtype_of(dt), idx[:5])}")
    return f"ok ({calls} calls issued in {issued:.2f} s, all correct)"


def c_b2b_tuned(env):
    """120 group calls of the tuned R=4 all-reduce whose counts move across size buckets
    (different schedules back to back on the same rank streams), then every output."""
    import torch
    np = _np()
    coll, g = env.load(4, "allreduce.pln", "tuned")
    spec, dtype = coll[0].compiled.spec, dtype_of(F32)
    counts = (1, 4097, 65537, 300001, 16, 1000003)
    rng = np.random.default_rng(120)
    sets = []
    for count in counts:
        inputs = make_inputs(spec, count, dtype, rng, "int")
        xs, _ = buffers(spec, count, dtype, inputs)
        sets.append((count, xs, [to_dev(w, dtype) for w in reference(spec, inputs, count, dtype)]))
    calls = 120
    outs_all = []
    for i in range(calls):
        count = sets[i % len(sets)][0]
        outs = [torch.empty(4 * count, device=f"cuda:{DEVICE}") for _ in range(4)]
        for o in outs:
            poison(o)
        outs_all.append(outs)
    cur = torch.cuda.current_stream(DEVICE)
    torch.cuda.synchronize(DEVICE)
    for s in g.streams:
        s.wait_stream(cur)
    for i in range(calls):
        coll(sets[i % len(sets)][1], outs_all[i], streams=g.streams)
    for s in g.streams:
        cur.wait_stream(s)
    torch.cuda.synchronize(DEVICE)
    coll.check()
    bad = [(i, r) for i in range(calls) for r in range(4)
           if not torch.equal(outs_all[i][r].view(torch.int32), sets[i % len(sets)][2][r].view(torch.int32))]
    if bad:
        i, r = bad[0]
        got, exp = bits_np(outs_all[i][r]), bits_np(sets[i % len(sets)][2][r])
        idx = np.flatnonzero(got != exp)
        raise Unexpected(f"wrong result in {len(bad)} of {4 * calls} rank outputs; first: call {i} rank {r} "
                         f"(count {sets[i % len(sets)][0]}): {idx.size} elements differ, first at {idx[:5].tolist()}")
    buckets = sorted({tuple_key(coll, c) for c in counts})
    return f"ok ({calls} calls over {len(buckets)} schedules: {', '.join(buckets)})"


def tuple_key(coll, count):
    return runs_for(coll, count, 4).compiled.options.key()


def c_sweep(R, name, dt, nbytes):
    def run(env):
        coll, g = env.load(R, name, "tuned")
        spec, dtype = coll[0].compiled.spec, dtype_of(dt)
        units = len(spec.inputs[0])
        count = max(1, nbytes // (dtype.itemsize * units))
        rng = _np().random.default_rng(nbytes + R)
        inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
        xs, outs = buffers(spec, count, dtype, inputs)
        gcall(coll, g, xs, outs)
        compare(outs, reference(spec, inputs, count, dtype), dtype)
        return (f"ok (count {count}: {count * units * dtype.itemsize} B in per rank; schedule "
                f"{runs_for(coll, count, dtype.itemsize).compiled.options.key()})")
    return run


def _fresh_inputs(spec, count, dtype, rng, xs, outs):
    import torch
    kind = "int" if spec.is_reduce else "bits"
    inputs = make_inputs(spec, count, dtype, rng, kind)
    for r, x in enumerate(xs):
        if x is not None:
            x.copy_(to_dev(inputs[r], dtype))
    for o in outs:
        poison(o)
    torch.cuda.synchronize(DEVICE)
    return inputs


def c_graph_per_rank(R, name, mode, dt, count, calls_per_graph=1, replays=10):
    """Per-rank CUDA graphs (each rank captured on its own stream, as the tests do) after one
    eager warm-up group call, replayed ``replays`` times with fresh inputs copied into the
    captured buffers; every output checked after every replay."""
    def run(env):
        import torch
        coll, g = env.load(R, name, mode)
        spec, dtype = coll[0].compiled.spec, dtype_of(dt)
        rng = _np().random.default_rng(count * 3 + R)
        xs, outs_list = None, []
        inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
        xs, outs = buffers(spec, count, dtype, inputs)
        outs_list.append(outs)
        for _ in range(calls_per_graph - 1):
            outs_list.append(buffers(spec, count, dtype, inputs)[1])
        for outs in outs_list:  # warm-up: compiles, loads, records the pointers for registration
            gcall(coll, g, xs, outs)
        before = sum(getattr(getattr(c, "_zc", None), "graph_registered", 0) or 0
                     for c in [runs_for(coll, count, dtype.itemsize)])
        graphs = []
        for r, s in enumerate(g.streams):
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr, stream=s):
                for outs in outs_list:
                    coll[r](xs[r], outs[r])
            graphs.append(gr)
        after = sum(getattr(getattr(c, "_zc", None), "graph_registered", 0) or 0
                    for c in [runs_for(coll, count, dtype.itemsize)])
        for it in range(replays):
            for outs in outs_list[1:]:
                for o in outs:
                    poison(o)
            inputs = _fresh_inputs(spec, count, dtype, rng, xs, outs_list[0])
            torch.cuda.synchronize(DEVICE)
            for gr, s in zip(graphs, g.streams):
                with torch.cuda.stream(s):
                    gr.replay()
            torch.cuda.synchronize(DEVICE)
            coll.check()
            want = reference(spec, inputs, count, dtype)
            for k, outs in enumerate(outs_list):
                compare(outs, want, dtype, f" (replay {it}, captured call {k})")
        how = "registered (zero-copy twin)" if after > before else "staged"
        return f"ok ({replays} replays x {calls_per_graph} call(s), captured calls {how})"
    return run


def c_graph_whole_group(R, name, mode, dt, count, warm=True, replays=10, tag=""):
    """One CUDA graph holding the group call (every rank on its own stream forked from the
    capturing one), replayed with fresh inputs; ``warm=False``: captured with no eager call of
    this collective before (a fresh load): works, or a clear PurlinError."""
    def run(env):
        import torch
        coll, g = env.load(R, name, mode, tag=tag)
        spec, dtype = coll[0].compiled.spec, dtype_of(dt)
        rng = _np().random.default_rng(count + 77)
        inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
        xs, outs = buffers(spec, count, dtype, inputs)
        if warm:
            gcall(coll, g, xs, outs)
        side = torch.cuda.Stream(device=DEVICE)
        graph = torch.cuda.CUDAGraph()
        from purlinc.errors import PurlinError
        try:
            with torch.cuda.graph(graph, stream=side):
                cur = torch.cuda.current_stream(DEVICE)
                for s in g.streams:
                    s.wait_stream(cur)
                coll(xs, outs, streams=g.streams)
                for s in g.streams:
                    cur.wait_stream(s)
        except PurlinError as error:
            if not warm:
                return f"refused at capture: {type(error).__name__}: {first_line(error)}"
            raise
        for it in range(replays):
            inputs = _fresh_inputs(spec, count, dtype, rng, xs, outs)
            graph.replay()
            torch.cuda.synchronize(DEVICE)
            coll.check()
            compare(outs, reference(spec, inputs, count, dtype), dtype, f" (replay {it})")
        return f"ok ({replays} replays{'' if warm else ', captured with no warm-up call'})"
    return run


def c_same_spec_twice(env):
    a, g = env.load(2, "allreduce.pln")
    b, _ = env.load(2, "allreduce.pln", tag="second load")
    spec, dtype = a[0].compiled.spec, dtype_of(F32)
    rng = _np().random.default_rng(31)
    calls = []
    for i in range(8):
        count = (4097, 33, 100003, 1)[i % 4]
        inputs = make_inputs(spec, count, dtype, rng, "int")
        xs, outs = buffers(spec, count, dtype, inputs)
        calls.append((a if i % 2 == 0 else b, xs, outs, reference(spec, inputs, count, dtype)))
    on_streams(g.streams, lambda: issue_group_calls(calls, g.streams))
    a.check()
    b.check()
    for i, (_, _, outs, want) in enumerate(calls):
        compare(outs, want, dtype, f" (call {i}, load {'AB'[i % 2]})")
    return "ok (two loads of one spec, 8 calls interleaved with no synchronisation)"


def c_two_collectives(env):
    ar, g = env.load(4, "allreduce.pln")
    ag, _ = env.load(4, "allgather.pln")
    rng = _np().random.default_rng(37)
    calls = []
    for i in range(20):
        coll = ar if i % 2 == 0 else ag
        spec, dtype = coll[0].compiled.spec, dtype_of(F32)
        count = (1000, 7, 65537, 3, 4097)[i % 5]
        inputs = make_inputs(spec, count, dtype, rng, "int" if spec.is_reduce else "bits")
        xs, outs = buffers(spec, count, dtype, inputs)
        calls.append((coll, xs, outs, reference(spec, inputs, count, dtype)))
    on_streams(g.streams, lambda: issue_group_calls(calls, g.streams))
    ar.check()
    ag.check()
    for i, (coll, _, outs, want) in enumerate(calls):
        compare(outs, want, dtype_of(F32), f" (call {i}, {coll.name})")
    return "ok (all-reduce and all-gather alternating, 20 calls, no synchronisation)"


def c_close_collective(env):
    coll, g = env.load(2, "allgather.pln", tag="closed by the probe")
    spec, dtype, count = coll[0].compiled.spec, dtype_of(F32), 512
    inputs = make_inputs(spec, count, dtype, _np().random.default_rng(41), "bits")
    xs, outs = buffers(spec, count, dtype, inputs)
    gcall(coll, g, xs, outs)
    compare(outs, reference(spec, inputs, count, dtype), dtype)
    coll.close()
    for o in outs:
        poison(o)
    result = refused(lambda: gcall(coll, g, xs, outs), outs, kinds=(Exception,), must=r"closed")
    coll.close()  # a second close: nothing
    other, _ = env.load(2, "allreduce.pln")
    spec2 = other[0].compiled.spec
    ins = make_inputs(spec2, count, dtype, _np().random.default_rng(43), "int")
    x2, o2 = buffers(spec2, count, dtype, ins)
    gcall(other, g, x2, o2)
    compare(o2, reference(spec2, ins, count, dtype), dtype, " (another collective of the group, after the close)")
    return result + "; the group's other collectives still work"


def _timeout_fixture(env):
    """A fresh R=2 group whose rank 0 alone calls the all-reduce: its wait must end in
    PurlinTimeoutError after PURLIN_WAIT_TIMEOUT_S (5 s)."""
    st = env.state.get("timeout")
    if st is not None:
        return st
    import torch
    g = new_group(2)
    coll = load_on(g, "allreduce.pln")
    spec, dtype, count = coll[0].compiled.spec, dtype_of(F32), 1024
    inputs = make_inputs(spec, count, dtype, _np().random.default_rng(47), "int")
    xs, outs = buffers(spec, count, dtype, inputs)
    gcall(coll, g, xs, outs)  # a good call first
    compare(outs, reference(spec, inputs, count, dtype), dtype)
    t0 = time.time()
    error = None
    try:
        with torch.cuda.stream(g.streams[0]):
            coll[0](xs[0], outs[0])
        torch.cuda.synchronize(DEVICE)
        coll.check()
    except Exception as e:  # noqa: BLE001
        error = e
    st = dict(g=g, coll=coll, xs=xs, outs=outs, error=error, seconds=time.time() - t0)
    env.state["timeout"] = st
    return st


def c_timeout(env):
    from purlinc.runtime.errors import PurlinTimeoutError
    st = _timeout_fixture(env)
    error, seconds = st["error"], st["seconds"]
    if error is None:
        raise Unexpected(f"rank 0 alone finished its call in {seconds:.1f} s with no error")
    if not isinstance(error, PurlinTimeoutError):
        raise Unexpected(f"{type(error).__name__} after {seconds:.1f} s: {first_line(error)}")
    if seconds > 20:
        raise Unexpected(f"PurlinTimeoutError only after {seconds:.1f} s (bound 5 s): {first_line(error)}")
    return f"PurlinTimeoutError after {seconds:.1f} s: {first_line(error)}"


def c_after_timeout(env):
    from purlinc.runtime.errors import PurlinTimeoutError
    st = _timeout_fixture(env)
    g, coll, xs, outs = st["g"], st["coll"], st["xs"], st["outs"]
    for o in outs:
        poison(o)
    results = [refused(lambda: gcall(coll, g, xs, outs), outs, kinds=(PurlinTimeoutError,), must=r"stopped|time")]
    results.append(refused(lambda: load_on(g, "allgather.pln"), (), kinds=(PurlinTimeoutError,), must=r"stopped|time"))
    try:
        g.close()
    except Exception as error:  # noqa: BLE001
        raise Unexpected(f"closing the stopped group raised {type(error).__name__}: {first_line(error)}")
    return "; ".join(results) + "; the stopped group closed cleanly"


def c_fresh_after_timeout(env):
    _timeout_fixture(env)
    g = new_group(2)
    try:
        coll = load_on(g, "allreduce.pln")
        spec, dtype, count = coll[0].compiled.spec, dtype_of(F32), 4097
        inputs = make_inputs(spec, count, dtype, _np().random.default_rng(53), "int")
        xs, outs = buffers(spec, count, dtype, inputs)
        gcall(coll, g, xs, outs)
        compare(outs, reference(spec, inputs, count, dtype), dtype)
    finally:
        g.close()
    return "ok (a new LocalGroup after the timeout works)"


def _closed_fixture(env):
    st = env.state.get("closed")
    if st is not None:
        return st
    g = new_group(2)
    flat = load_on(g, "allreduce.pln")
    tuned = load_on(g, "allreduce.pln", "tuned")
    spec, dtype, count = flat[0].compiled.spec, dtype_of(F32), 1024
    inputs = make_inputs(spec, count, dtype, _np().random.default_rng(59), "int")
    xs, outs = buffers(spec, count, dtype, inputs)
    want = reference(spec, inputs, count, dtype)
    for coll in (flat, tuned):
        gcall(coll, g, xs, outs)
        compare(outs, want, dtype)
    g.close()
    for o in outs:
        poison(o)
    st = dict(g=g, flat=flat, tuned=tuned, xs=xs, outs=outs)
    env.state["closed"] = st
    return st


def c_closed_group_call(which):
    def run(env):
        st = _closed_fixture(env)
        g, coll, xs, outs = st["g"], st[which], st["xs"], st["outs"]
        from purlinc.errors import PurlinError
        return refused(lambda: gcall(coll, g, xs, outs), outs, kinds=(PurlinError,), must=r"closed")
    return run


def c_load_on_closed_group(env):
    st = _closed_fixture(env)
    return refused(lambda: load_on(st["g"], "allreduce.pln"), (), must=r"closed")


# ------------------------------------------------------------------------------------------

def build_cases() -> list:
    cases = []
    only = re.compile(os.environ["PROBE_ONLY"]) if os.environ.get("PROBE_ONLY") else None
    cap = float(os.environ.get("PROBE_CASE_BOUND_S") or 1e9)

    def add(name, group, expected, fn, bound=45):
        if only is None or only.search(name):
            cases.append(Case(name, group, expected, fn, min(bound, cap)))

    correct = "correct: every rank's output bit for bit as evaluate() says (outputs poisoned first)"
    add("setup/probe_self_check", "setup", "the probe's checks catch an unwritten, a changed and a misplaced element",
        c_selfcheck)
    add("setup/precompile_kernels", "setup", "every kernel the probe uses compiles (NVRTC, in parallel)",
        c_precompile, 200)
    for R in (2, 4, 3):
        for name, dtypes in COUNT_MATRIX:
            for dt in dtypes:
                if R == 3 and dt != F32:
                    continue
                for count in COUNTS:
                    add(f"count/{name[:-4]}/R{R}/{dt}/n={count}", "counts", correct + "; count 0 returns at once",
                        c_count(R, name, dt, count))
    for dt in (F32, BF16):
        for count in (0, 1, 7, 1000003):
            add(f"count/broadcast_root3/R4/{dt}/n={count}", "counts", correct + " (load(..., params={'root': 3}))",
                c_count(4, "broadcast.pln", dt, count, params={"root": 3}))
    add("load/broadcast_root_out_of_range", "load errors", "a PurlinError at load naming the root, nothing allocated",
        c_param_errors("root_out_of_range"))
    add("load/unknown_param", "load errors", "a PurlinError at load naming the parameter",
        c_param_errors("unknown_param"))
    add("load/allreduce_R4_channels512_residency", "load errors",
        "ResidencyError (an ArgumentError) before any launch, or correct; never a hang", c_residency)
    for name, dt in (("allreduce.pln", F32), ("allgather.pln", BF16)):
        for point in BOUNDARY_POINTS:
            add(f"staging/{name[:-4]}/R2/{dt}/{point}", "staging boundaries",
                correct + " (PURLIN_STAGE_MB=4: counts at the small/large region edges and multi-round calls)",
                c_boundary(name, dt, point))
    for mode, name, dt, count in ALIGN_TARGETS:
        for label, xo, oo in ALIGN_OFFSETS:
            add(f"align/{mode}/{name[:-4]}/R2/{dt}/n={count}/{label}", "misaligned views",
                "correct, or ArgumentError before any launch (outputs untouched); never a wrong result or crash",
                c_align(mode, name, dt, count, xo, oo))
    add("align/cupy_x_one_byte_off/allreduce/R2/float32", "misaligned views",
        "ArgumentError naming x (not aligned to its element), nothing launched", c_cupy_misaligned)
    add("interop/cupy_inputs/allreduce/R2/float32", "interop", correct, c_cupy_inputs)
    for which in ("x_transposed", "x_strided_slice", "x_expanded_stride0", "out_transposed", "out_strided_slice"):
        add(f"noncontig/{which}", "non-contiguous",
            "ArgumentError naming the tensor ('not contiguous') before launch, or handled correctly",
            c_noncontig(which))
    add("noncontig/x_out_2d_contiguous", "non-contiguous", correct + " (2-D contiguous tensors are fine)",
        c_noncontig("x_out_2d_contiguous"))
    for which, expected in (
            ("inplace_all_ranks", "ArgumentError (x and out overlap; in-place not supported), or correct"),
            ("inplace_rank0_only", "ArgumentError (overlap) before launch, or correct"),
            ("partial_overlap", "ArgumentError (overlap) before launch, or correct"),
            ("adjacent_no_overlap", correct),
            ("allgather_output_slot_as_input", "ArgumentError (overlap), or correct (torch's in-place all-gather)"),
            ("cross_rank_alias", "refused or correct; a wrong result is a note (undefined by any doc)")):
        add(f"overlap/{which}", "in-place / overlap", expected, c_overlap(which))
    for which, expected in (
            ("out_too_small", "ArgumentError naming out"), ("out_too_large", "ArgumentError naming out"),
            ("x_not_a_multiple_of_R", "ArgumentError naming x"),
            ("counts_differ_between_ranks", "MismatchError on the count, nothing launched"),
            ("out_dtype_differs_from_x", "ArgumentError naming out's dtype"),
            ("dtypes_differ_between_ranks", "MismatchError on the dtype"),
            ("x_on_cpu", "ArgumentError naming x (on the host)"), ("out_on_cpu", "ArgumentError naming out"),
            ("x_float64", "ArgumentError naming the unsupported dtype"),
            ("x_none_on_a_rank_that_gives", "ArgumentError: x is required"),
            ("xs_has_R-1_entries", "ArgumentError naming xs"), ("xs_is_one_tensor", "ArgumentError naming xs"),
            ("one_stream_for_every_rank", "ArgumentError: ranks sharing a GPU need a stream each"),
            ("no_streams", "ArgumentError: ranks sharing a GPU need a stream each"),
            ("count_kwarg_disagrees", "ArgumentError on count="), ("count_kwarg_is_a_str", "ArgumentError on count="),
            ("unknown_op", "ArgumentError naming the op"),
            ("broadcast_non_root_passes_x", "ArgumentError: this rank gives no input"),
            ("outs_none_allocates", correct + " (outputs allocated and returned)"),
            ("correct_call_after_refusals", correct)):
        add(f"args/{which}", "wrong arguments", expected + ("" if "correct" in expected else
                                                            "; outputs untouched"), c_wrong(which))
    for dt, op, kind in OPS_ROWS:
        exp = ("bit for bit vs evaluate (order-independent)" if dt == I32 or kind == "negzero"
               else "bit for bit vs the SNAC simulator of the schedule that ran (NaN payloads aside), "
                    "replicated outputs equal on every rank")
        if kind == "negzero":
            exp += "; every output -0.0"
        if op == "MAX":
            exp = "accepted (ops are case-insensitive) and correct, or a clear ArgumentError"
        add(f"ops/allreduce/R4/{dt}/{op}/{kind}", "reduce ops", exp, c_op(dt, op, kind))
    for op in ("sum", "max", "min"):
        add(f"ops/reduce_scatter/R4/float32/{op}/special", "reduce ops",
            "bit for bit vs the SNAC simulator (NaN payloads aside)", c_op(F32, op, "special", "reduce_scatter.pln"))
    for dt, op, kind in ((F32, "prod", "special"), (F32, "max", "special"), (F32, "min", "special"),
                         (I32, "prod", "i32full"), (I32, "max", "i32full"), (I32, "min", "i32full")):
        add(f"ops/allreduce/R2/{dt}/{op}/{kind}", "reduce ops",
            "bit for bit vs " + ("evaluate" if dt == I32 else "the SNAC simulator (NaN payloads aside)"),
            c_op(dt, op, kind, R=2))
    add("ops/allreduce/R3/float32/max/special", "reduce ops", "bit for bit vs the SNAC simulator (NaN payloads aside)",
        c_op(F32, "max", "special", R=3, count=1001))
    add("ops/allreduce/R2/float32/avg", "reduce ops",
        "ArgumentError naming the op (the core API documents sum/prod/max/min; avg is purlinc.torch's)", c_avg)
    for which, expected in (("heap_aligned", correct), ("x_view_+1", correct + " (heap views at odd offsets)"),
                            ("x+3_out+1_views", correct + " (heap views at odd offsets)"),
                            ("allgather_bf16_heap", correct),
                            ("heap_on_rank0_only", "MismatchError (ranks disagree on the zero-copy path), or correct"),
                            ("views_at_different_offsets_per_rank",
                             "MismatchError (different heap offsets), or correct")):
        add(f"zerocopy/{which}", "zero-copy heap buffers", expected, c_zerocopy(which))
    add("life/concurrent_collectives_on_two_stream_sets", "lifecycle", correct, c_concurrent_streams)
    add("life/same_spec_loaded_twice_interleaved", "lifecycle", correct, c_same_spec_twice)
    add("life/two_collectives_interleaved", "lifecycle", correct, c_two_collectives)
    add("life/closed_collective_called", "lifecycle",
        "ArgumentError ('closed') before launch; a second close is harmless; the group's others still work",
        c_close_collective)
    add("b2b/allreduce/R2/pinned/1000_calls_counts_and_dtypes_alternating", "back-to-back",
        "all 1000 calls correct, no timeout", c_b2b_pinned, 120)
    add("b2b/allreduce/R4/tuned/120_calls_across_buckets", "back-to-back", "all 120 calls correct, no timeout",
        c_b2b_tuned, 120)
    for R in (2, 4, 3):
        for name, dt in (("allreduce.pln", F32), ("allgather.pln", BF16)):
            if R == 3 and name != "allreduce.pln":
                continue
            for nbytes in SWEEP_BYTES:
                add(f"tuned/{name[:-4]}/R{R}/{dt}/{nbytes}B", "tuned sweep",
                    correct + " (plain load(), size picks the schedule)", c_sweep(R, name, dt, nbytes), 60)
    for R in (2, 4):
        add(f"tuned/allreduce/R{R}/float32/bucket_edges", "tuned sweep",
            correct + " at each bucket's largest count and one past it", c_tuned_edges(R), 90)
    add("graph/per_rank/allreduce/R4/pinned/float32/n=4097", "cuda graphs", correct + " after each of 10 replays",
        c_graph_per_rank(4, "allreduce.pln", "pinned", F32, 4097))
    add("graph/per_rank/allreduce/R2/pinned/float32/n=1001/3_calls", "cuda graphs",
        correct + " for each of 3 captured calls after each of 10 replays",
        c_graph_per_rank(2, "allreduce.pln", "pinned", F32, 1001, calls_per_graph=3))
    add("graph/per_rank/allreduce/R2/tuned/float32/n=1000", "cuda graphs", correct + " after each of 10 replays (LL)",
        c_graph_per_rank(2, "allreduce.pln", "tuned", F32, 1000))
    add("graph/per_rank/allreduce/R2/tuned/float32/n=65537", "cuda graphs", correct + " after each of 10 replays",
        c_graph_per_rank(2, "allreduce.pln", "tuned", F32, 65537))
    add("graph/whole_group/allgather/R4/tuned/bfloat16/n=100003", "cuda graphs",
        correct + " after each of 10 replays", c_graph_whole_group(4, "allgather.pln", "tuned", BF16, 100003))
    add("graph/whole_group/allreduce/R2/pinned/float32/no_warmup", "cuda graphs",
        "correct after 10 replays, or a clear PurlinError at capture (docs ask for a warm-up call)",
        c_graph_whole_group(2, "allreduce.pln", "pinned", F32, 4097, warm=False, tag="no warm-up"))
    add("life/timeout_rank0_alone", "lifecycle", "PurlinTimeoutError within ~5 s (PURLIN_WAIT_TIMEOUT_S=5)",
        c_timeout, 60)
    add("life/after_timeout_calls_and_loads_refused", "lifecycle",
        "PurlinTimeoutError ('stopped') for a call and a load; close() works", c_after_timeout, 60)
    add("life/after_timeout_fresh_group_works", "lifecycle", correct, c_fresh_after_timeout, 60)
    add("life/closed_group_pinned_call", "lifecycle", "a PurlinError saying closed, nothing launched",
        c_closed_group_call("flat"), 60)
    add("life/load_on_closed_group", "lifecycle", "ArgumentError: the communicator is closed",
        c_load_on_closed_group, 60)
    add("life/closed_group_tuned_call", "lifecycle", "a PurlinError saying closed (not a crash)",
        c_closed_group_call("tuned"), 60)
    return cases


# ==========================================================================================
# the child

def _inject(name: str) -> None:
    """PROBE_INJECT (testing the probe): make the matching case crash, hang or break CUDA."""
    for item in filter(None, (os.environ.get("PROBE_INJECT") or "").split(";")):
        pattern, _, what = item.rpartition("=")
        if not re.search(pattern, name):
            continue
        if what == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif what == "hang":
            time.sleep(10 ** 6)
        elif what == "cudafault":
            import cupy
            import numpy as np
            kernel = cupy.RawKernel('extern "C" __global__ void f(int* p) { *p = 1; }', "f")
            kernel((1,), (1,), (np.uint64(8),))  # a store to address 8: a sticky illegal-address error
            cupy.cuda.Device(DEVICE).synchronize()

def child_main(start: int, rows_path: str, deadline: float) -> int:
    cases = build_cases()
    rows = open(rows_path, "a", buffering=1)

    def emit(obj):
        rows.write(json.dumps(obj) + "\n")
        rows.flush()
        os.fsync(rows.fileno())

    import torch  # noqa: F401
    import purlinc  # noqa: F401
    env = Env()
    for index in range(start, len(cases)):
        case = cases[index]
        if time.time() > deadline:
            emit({"event": "row", "index": index, "case": case.name, "group": case.group, "expected": case.expected,
                  "happened": "not run: the probe's time budget ran out", "status": "skipped", "seconds": 0.0})
            continue
        emit({"event": "start", "index": index, "case": case.name, "t": time.time()})
        t0 = time.time()
        status, detail, fatal = "ok", None, False
        try:
            _inject(case.name)
            happened = case.fn(env) or "ok"
            if isinstance(happened, str) and happened.startswith("n/a"):
                status = "ok"
        except Unexpected as error:
            status, happened = "unexpected", str(error)
        except Note as error:
            status, happened = ("skipped" if str(error).startswith("skipped") else "note"), str(error)
        except Exception as error:  # noqa: BLE001 - every case is recorded, whatever it raised
            status = "unexpected"
            prefix = "timeout: " if isinstance(error, TimeoutError) else ""
            happened = f"{prefix}{type(error).__name__}: {first_line(error)}"
            detail = traceback.format_exc()[-1500:]
            try:
                env.refresh()
            except Exception:  # noqa: BLE001
                pass
            fatal = not gpu_healthy()
        seconds = round(time.time() - t0, 2)
        row = {"event": "row", "index": index, "case": case.name, "group": case.group, "expected": case.expected,
               "happened": happened, "status": status, "seconds": seconds}
        if detail:
            row["detail"] = detail
        emit(row)
        mark = {"ok": "ok", "unexpected": "UNEXPECTED", "note": "note", "skipped": "skipped"}[status]
        print(f"[{mark:>10}] {case.name} ({seconds:.2f} s): {happened[:300]}", flush=True)
        if fatal:
            print(f"[     fatal] the CUDA context is broken after {case.name}: starting a new process", flush=True)
            rows.close()
            os._exit(FATAL_EXIT)
    rows.close()
    return 0


# ==========================================================================================
# the parent

def _meta() -> dict:
    meta = {"argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
            "settings": {k: v for k, v in os.environ.items() if k.startswith("PURLIN_")}}
    try:
        from purlinc.version import __version__
        meta["purlinc"] = __version__
    except Exception:  # noqa: BLE001
        pass
    try:
        meta["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        meta["gpu"] = "unknown"
    return meta


def parent_main() -> int:
    t_start = time.time()
    budget = float(os.environ.get("PROBE_BUDGET_S", "285"))
    deadline = t_start + budget
    out_dir = Path(os.environ.get("OUT") or "/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "probe_edges.json"
    rows_path = out_dir / "probe_edges_rows.jsonl"
    err_path = out_dir / "probe_edges_stderr.log"
    rows_path.write_text("")
    err_path.write_text("")
    cases = build_cases()
    meta = _meta()
    rows: dict[int, dict] = {}
    state = {"proc": None}

    def write_json(final=False):
        ordered = [rows[i] for i in sorted(rows)]
        counts = {}
        for r in ordered:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        doc = {"meta": {**meta, "seconds": round(time.time() - t_start, 1), "finished": final,
                        "cases": len(cases)},
               "summary": {"ok": counts.get("ok", 0), "unexpected": counts.get("unexpected", 0),
                           "note": counts.get("note", 0), "skipped": counts.get("skipped", 0),
                           "unexpected_cases": [r["case"] for r in ordered if r["status"] == "unexpected"],
                           "note_cases": [r["case"] for r in ordered if r["status"] == "note"]},
               "rows": ordered}
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(json_path)
        return doc

    def kill_child():
        proc = state["proc"]
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own process group
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                pass

    def on_term(signum, frame):  # `timeout` sends SIGTERM: keep what we have
        kill_child()
        for i, case in enumerate(cases):
            rows.setdefault(i, {"index": i, "case": case.name, "group": case.group, "expected": case.expected,
                                "happened": f"not run: the probe was stopped (signal {signum})",
                                "status": "skipped", "seconds": 0.0})
        write_json(final=True)
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    def stderr_tail(n=1200):
        try:
            return err_path.read_text(errors="replace")[-n:]
        except Exception:  # noqa: BLE001
            return ""

    offset = 0

    def read_rows(current):
        nonlocal offset
        with open(rows_path, "rb") as f:
            f.seek(offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        offset += cut
        changed = False
        for line in data[:cut].decode("utf-8", "replace").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("event") == "start":
                current = (obj["index"], time.time())
            elif obj.get("event") == "row":
                obj.pop("event", None)
                rows[obj["index"]] = obj
                changed = True
                if current is not None and current[0] == obj["index"]:
                    current = None
        return current, changed

    print(f"probe_edges: {len(cases)} cases, budget {budget:.0f} s, results in {json_path}", flush=True)
    start, launches = 0, 0
    while start < len(cases) and time.time() < deadline - 3 and launches < 12:
        launches += 1
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--start", str(start),
               "--rows", str(rows_path), "--deadline", str(deadline - 4)]
        with open(err_path, "ab") as err:
            state["proc"] = subprocess.Popen(cmd, stdout=None, stderr=err, start_new_session=True, cwd=str(ROOT))
        proc = state["proc"]
        current, killed = None, None
        while True:
            current, changed = read_rows(current)
            if changed:
                write_json()
            if proc.poll() is not None:
                break
            if current is not None and time.time() - current[1] > cases[current[0]].bound:
                killed = f"hang: no result within the case's bound of {cases[current[0]].bound} s (process killed)"
                kill_child()
                break
            if time.time() > deadline:
                killed = "not finished when the probe's time budget ran out (process killed)"
                kill_child()
                break
            time.sleep(0.2)
        current, _ = read_rows(current)
        rc = proc.returncode
        if current is not None:  # a case started and never reported
            i = current[0]
            if killed is None:
                what = (f"crash: the process died with signal {-rc}" if rc is not None and rc < 0
                        else f"crash: the process exited with status {rc}")
            else:
                what = killed
            rows[i] = {"index": i, "case": cases[i].name, "group": cases[i].group, "expected": cases[i].expected,
                       "happened": what, "status": "unexpected" if "budget" not in what else "skipped",
                       "seconds": round(time.time() - current[1], 2), "detail": stderr_tail()}
            print(f"[{'UNEXPECTED':>10}] {cases[i].name}: {what}", flush=True)
            start = i + 1
        else:
            done = [i for i in rows if i >= start]
            start = (max(done) + 1) if done else (len(cases) if rc == 0 else start + 1)
            if rc not in (0, FATAL_EXIT) and start < len(cases):
                print(f"probe_edges: the child exited with status {rc} between cases; starting again at "
                      f"{cases[start].name}\n{stderr_tail(600)}", flush=True)
        write_json()
    for i, case in enumerate(cases):
        if i not in rows:
            rows[i] = {"index": i, "case": case.name, "group": case.group, "expected": case.expected,
                       "happened": "not run: the probe's time budget ran out", "status": "skipped", "seconds": 0.0}
    doc = write_json(final=True)
    s = doc["summary"]
    print(f"probe_edges: {s['ok']} ok, {s['unexpected']} unexpected, {s['note']} note, {s['skipped']} skipped "
          f"of {len(cases)} cases in {time.time() - t_start:.0f} s -> {json_path}", flush=True)
    for name in s["unexpected_cases"]:
        print(f"  unexpected: {name}: {rows[[c.name for c in cases].index(name)]['happened'][:240]}", flush=True)
    return 1 if s["unexpected"] or s["skipped"] else 0  # a suite step fails on either


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the cases and exit (no GPU needed)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: the process running cases
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child and (args.rows is None or args.deadline is None):
        ap.error("--child needs --rows and --deadline (it is started by the probe itself)")
    return args


def main(argv) -> int:
    args = parse_args(argv)
    if args.list:
        for i, case in enumerate(build_cases()):
            print(f"{i:4d} {case.group:20s} {case.name}  [{case.bound}s]  expect: {case.expected}")
        return 0
    if args.child:
        return child_main(args.start, args.rows, args.deadline)
    return parent_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
