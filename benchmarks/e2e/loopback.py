"""The e2e benchmark in loopback: one process, every rank on cuda:0 with its own stream
(``LocalGroup([0] * R, share_devices=True)``), the all-reduces group calls.  The whole step
of every rank is one CUDA graph: each step forks the ranks' streams from the capturing stream
and joins them back.  Correctness is real (the same kernels and signals as across GPUs); the
times are one GPU's, shared by every rank, and say nothing about links."""

from __future__ import annotations

import statistics
import traceback

import torch

from e2e import model, results, systems
from e2e.timing import capture, replay_us

DEVICE = 0


def _make(system: str, group, streams, hidden: int) -> model.GroupComm:
    if system == "none":
        return systems.NoGroupOnStreams(streams)
    if system == "reference":
        return systems.SumGroupOnStreams(streams)
    if system == "purlin-fused":
        return systems.PurlinGroup(group, streams, fused_hidden=hidden)
    return systems.PurlinGroup(group, streams, heap=system == "purlin-heap")


def _step(shard, weights, states, comm, buffers, streams):
    def step():
        current = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(current)
        ys = model.decode_step_group(shard, weights, states, comm, buffers)
        for s in streams:
            current.wait_stream(s)
        return ys

    return step


def run_system(ctx: dict, system: str, batch: int, states, h0s, reference) -> tuple[dict, list | None]:
    shard, args, R = ctx["shard"], ctx["args"], ctx["shard"].world
    try:
        if system not in ctx["made"]:
            ctx["made"][system] = _make(system, ctx["group"], ctx["streams"], shard.config.hidden)
        comm = ctx["made"][system]
        buffers = model.group_buffers(shard, batch, comm, torch.bfloat16, DEVICE)
        for s, h0 in zip(states, h0s):
            s.h.copy_(h0)
        graph, ys = capture(_step(shard, ctx["weights"], states, comm, buffers, ctx["streams"]))
        times = replay_us(graph, args.replays, args.reps, f"loopback {system} batch {batch}")
        for s, h0 in zip(states, h0s):
            s.h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        finals = [y.clone() for y in ys]
    except systems.Absent as error:
        return results.row(system, batch, R, None, None, error=f"absent: {error}", loopback=True), None
    except Exception as error:  # noqa: BLE001 - the system's row says what failed
        traceback.print_exc()
        return results.row(system, batch, R, None, None, error=f"{type(error).__name__}: {str(error)[:400]}",
                           loopback=True), None
    agree = None
    if system == "reference":
        agree = results.reference_agrees(finals, "the reference (partial sums added in float32)")
    elif system != "none" and reference is not None:
        checks = [results.agree(y, want, results.TOLERANCE) for y, want in zip(finals, reference)]
        bad = [f"rank {r}: {note}" for r, (good, note) in enumerate(checks) if not good]
        agree = (not bad, "; ".join(bad) if bad else checks[0][1])
    return results.row(system, batch, R, statistics.median(times), times, agree=agree, loopback=True), finals


def run(args, config: model.Config) -> list[dict]:
    import purlinc

    R = args.loopback
    shard = config.shard(R)
    group = purlinc.LocalGroup([DEVICE] * R, share_devices=True)
    streams = [torch.cuda.Stream(device=DEVICE) for _ in range(R)]
    ctx = {"args": args, "shard": shard, "group": group, "streams": streams, "made": {},
           "weights": [model.make_weights(shard, r, seed=args.seed, device=DEVICE) for r in range(R)]}
    rows = []
    try:
        for batch in args.batch_list:
            states = [model.make_state(shard, r, batch, seed=args.seed, device=DEVICE) for r in range(R)]
            h0s = [s.h.clone() for s in states]
            reference = None
            for system in args.system_list:
                row, finals = run_system(ctx, system, batch, states, h0s, reference)
                if system == "reference":
                    reference = finals
                rows.append(row)
                print(f"loopback R={R} batch {batch:>4} {system:>14}: {row.get('step_us') or row.get('error')}",
                      flush=True)
                if getattr(group[0], "failed", None) is not None:
                    raise SystemExit("the loopback group stopped after a timeout: see the rows so far")
            del states
            torch.cuda.empty_cache()
    finally:
        group.close()
    return rows
