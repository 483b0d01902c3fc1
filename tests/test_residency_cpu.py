"""Ranks that share a GPU need all their blocks resident at once (``purlinc.runtime.residency``):
the refusal's arithmetic and text, the channel cap the tuned loader applies, and that a loopback
group's tuned buckets all fit.  The group call's refusal before any launch is tested with the
runtime's load path in test_runtime_load_cpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from purlinc.runtime import residency
from purlinc.runtime.errors import ArgumentError, ResidencyError
from purlinc.runtime.residency import Blocks

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
H200_SMS = 132


def _sms(device: int) -> int:
    return H200_SMS


def test_ranks_sharing_a_gpu_are_refused_past_what_it_holds():
    with pytest.raises(ResidencyError) as caught:
        residency.check("ar_2d", [Blocks(r, 0, 34, 256, 2) for r in range(8)], _sms)
    error = caught.value
    assert isinstance(error, ArgumentError) and (error.device, error.needed, error.limit) == (0, 272, 264)
    assert str(error) == (
        "error: ar_2d: this call needs 272 blocks resident at once on cuda:0 (8 ranks x 34 channels of 256 "
        "threads, ranks 0-7 sharing that GPU), but cuda:0 holds at most 264 of them (2 per SM x 132 SMs, by the "
        "kernel's registers, shared memory and threads); nothing was launched\n"
        "note: ranks that share a GPU wait for each other's blocks: blocks that cannot start would leave the "
        "others waiting until they time out\n"
        "note: load it with fewer channels (channels=33 or fewer per rank here), or give each rank a GPU of its own")


def test_exactly_full_fits():
    residency.check("ar", [Blocks(r, 0, 33, 256, 2) for r in range(8)], _sms)  # 264 of 264


def test_a_rank_alone_on_its_gpu_is_never_refused():
    """Its channels wait only for other GPUs' blocks (docs/RELIABILITY.md): a grid larger than
    the GPU holds still completes, block by block."""
    residency.check("ar", [Blocks(r, r, 1000, 512, 1) for r in range(8)], _sms)


def test_only_the_shared_gpu_counts():
    launches = [Blocks(0, 0, 100, 256, 1), Blocks(1, 0, 40, 256, 1), Blocks(2, 1, 500, 256, 1)]
    with pytest.raises(ResidencyError) as caught:
        residency.check("x", launches, _sms)
    assert (caught.value.device, caught.value.needed, caught.value.limit) == (0, 140, 132)
    assert "2 ranks, 40/100 channels" in str(caught.value) and "ranks 0, 1 sharing" in str(caught.value)


def test_kernels_of_different_occupancy_share_the_sms():
    """Each block takes 1/per_sm of an SM: 100 blocks at 4 per SM and 100 at 1 per SM need
    125 SMs (fits 132); 130 of the second kind need 155 (does not)."""
    residency.check("x", [Blocks(0, 0, 100, 128, 4), Blocks(1, 0, 100, 512, 1)], _sms)
    with pytest.raises(ResidencyError):
        residency.check("x", [Blocks(0, 0, 100, 128, 4), Blocks(1, 0, 130, 512, 1)], _sms)


def test_a_kernel_that_fits_nowhere_is_refused():
    with pytest.raises(ResidencyError):
        residency.check("x", [Blocks(0, 0, 1, 1024, 0), Blocks(1, 0, 1, 1024, 0)], _sms)


@pytest.mark.parametrize("devices,cap", [([0] * 8, 16), ([0] * 16, 8), ([0, 0], 66), ([0, 1], None),
                                         ([0, 0, 0, 1, 1], 44), ([0] * 200, 1)])
def test_channel_cap(devices, cap):
    assert residency.max_channels(devices, _sms) == cap


def test_tuned_buckets_are_capped_where_ranks_share_a_gpu():
    """A loopback group at R=8 on 132 SMs: no bucket above 16 channels (one block per SM fits
    whatever the kernel's registers), where the uncapped table goes higher."""
    from purlinc.runtime.tuned import prepare_tuned

    plain, _ = prepare_tuned(EXAMPLES / "allreduce.pln", 8)
    assert max(p.bucket.channels for p in plain) > 16  # the cap below changes something
    capped, _ = prepare_tuned(EXAMPLES / "allreduce.pln", 8, max_channels=16)
    assert [p.bucket.max_bytes for p in capped] == [p.bucket.max_bytes for p in plain]
    for before, after in zip(plain, capped):
        assert after.bucket.channels == min(before.bucket.channels, 16)
        assert after.compiled.options.channels == after.bucket.channels


def test_a_loopback_group_loads_capped_buckets(monkeypatch):
    """load() of a loopback group hands the cap to prepare_tuned; separate GPUs get none."""
    from purlinc.runtime import communicator, driver, tuned
    from purlinc.runtime.options import LoadOptions

    seen = []

    class Stop(Exception):
        pass

    def prepare(*args, max_channels=None, **kwargs):
        seen.append(max_channels)
        raise Stop

    class Group:
        def __init__(self, devices):
            self.comms = [type("C", (), {"device": d, "world_size": len(devices)})() for d in devices]

    monkeypatch.setattr(tuned, "prepare_tuned", prepare)
    monkeypatch.setattr(communicator, "LocalGroup", Group)
    monkeypatch.setattr(driver, "sm_count", _sms)
    for devices in ([0] * 8, [0, 1]):
        group = Group(devices)
        with pytest.raises(Stop):
            tuned.load_tuned(EXAMPLES / "allreduce.pln", group, group.comms, LoadOptions(arch="sm_90"))
    assert seen == [16, None]


def _comm(device, *, group_devices=None, peer_devices=()):
    group = type("G", (), {"devices": list(group_devices)})() if group_devices is not None else None
    return type("C", (), {"device": device, "local_group": group, "peer_devices": tuple(peer_devices)})()


@pytest.mark.parametrize("comm, shared", [
    (_comm(0, group_devices=[0] * 8), True),              # a loopback group
    (_comm(1, group_devices=[0, 1]), False),              # one GPU per rank
    (_comm(0, peer_devices=[0, 0, 1, 1]), True),          # torchrun ranks placed two per GPU
    (_comm(2, peer_devices=[0, 1, 2, 3]), False),
    (_comm(0), False),                                    # a world of one
])
def test_shares_gpu(comm, shared):
    assert residency.shares_gpu(comm) is shared


def test_no_dependent_launch_where_ranks_share_a_gpu(monkeypatch):
    """A dependent launch lets the next call's blocks hold SMs while they wait for this call; on a
    shared GPU those SMs may be the ones another rank's current call needs to start (R=8 loopback
    graphs of back-to-back calls timed out).  The collective's launch config drops it there."""
    from purlinc.runtime import collective

    for comm, expected in ((_comm(0, group_devices=[0] * 8), False), (_comm(0, group_devices=[0, 1]), True)):
        monkeypatch.setattr(collective.settings, "pdl", lambda: True)
        decided = collective.dependent_launch(comm, has_pdl=lambda device: True)
        assert decided is expected


@pytest.mark.parametrize("devices, shared", [([0, 0], True), ([0, 1], False), ([0, 1, 0], True), ([3], False)])
def test_a_group_shares_a_gpu_the_same_way_on_every_rank(devices, shared):
    from purlinc.runtime.residency import group_shares_a_gpu

    assert all(group_shares_a_gpu(_comm(device, group_devices=devices)) is shared for device in devices)
    # torchrun ranks the bootstrap placed: rank 1 of [0, 1, 0] has a GPU of its own, its group does not
    assert group_shares_a_gpu(_comm(1, peer_devices=[0, 1, 0]))


def test_the_ce_atom_is_refused_where_ranks_share_a_gpu_before_anything_is_allocated():
    from purlinc import pipeline
    from purlinc.errors import PurlinError
    from purlinc.runtime.placement import load_compiled

    compiled = pipeline.prepare(EXAMPLES / "allgather.pln", world_size=2, atom="ce")
    comms = [_comm(0, group_devices=[0, 0]) for _ in range(2)]
    with pytest.raises(PurlinError, match="the ce atom cannot run where ranks share a GPU") as info:
        load_compiled(compiled, comms[0], comms)  # a fake comm has no heap: allocating would fail otherwise
    assert any("ldst or tma" in note for note in info.value.notes)
