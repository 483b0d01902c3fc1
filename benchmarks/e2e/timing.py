"""Capturing a whole decode step in one CUDA graph and timing its replays (both launchers)."""

from __future__ import annotations

import torch

from benchlib.timing import capture_with_result, replays_us


def capture(step):
    """(graph, what the captured step returned): two warm-up steps on a side stream first, as
    torch recommends (they also compile and load every kernel the step uses).  One step per
    graph: a replay is one decode step."""
    return capture_with_result(step, 1)


def replay_us(graph, replays: int, reps: int, label: str) -> list[float]:
    """Per-step time of ``reps`` repeats of ``replays`` back-to-back replays (NVTX-labelled)."""
    graph.replay()
    torch.cuda.synchronize()
    return [replays_us(graph, replays, label) / replays for _ in range(reps)]
