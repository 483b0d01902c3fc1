"""Capturing a whole decode step in one CUDA graph and timing its replays (both launchers)."""

from __future__ import annotations

import torch

from benchlib.timing import replays_us


def capture(step):
    """(graph, what the captured step returned): two warm-up steps on a side stream first, as
    torch recommends (they also compile and load every kernel the step uses)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()
    return graph, out


def replay_us(graph, replays: int, reps: int, label: str) -> list[float]:
    """Per-step time of ``reps`` repeats of ``replays`` back-to-back replays (NVTX-labelled)."""
    graph.replay()
    torch.cuda.synchronize()
    return [replays_us(graph, replays, label) / replays for _ in range(reps)]
