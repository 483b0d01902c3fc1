"""Any torch process group as a Purlin group, made safely.

``group=`` in :mod:`purlinc.torch` takes a ``torch.distributed.ProcessGroup`` (``WORLD``, one from
``new_group``, a ``DeviceMesh`` dimension's) as well as a :class:`~purlinc.torch.distributed.Group`.
The Purlin communicator of a process group is made on the first call that needs it, by every
member of that group (a call on a group is a collective of its members), and cached per group.

How it is made matters.  ``torch.distributed.new_group`` must be called by *every* rank of the
world, so a communicator for one tensor-parallel group cannot make a helper group from inside
that group's members alone (tried: ranks of different groups met in one exchange, or their
connections were reset).  ``Communicator.from_torch(pg)`` exchanges over the process group's own
store instead (:mod:`purlinc.runtime.torchstore`): no other group can read or write those keys,
and nothing but the group's members takes part.
"""

from __future__ import annotations

import torch.distributed as dist

from purlinc.runtime.errors import ArgumentError

_GROUPS: dict[int, tuple[object, object]] = {}  # id(process group) -> (the group, its Purlin Group)
_BY_NAME: dict[str, object] = {}  # process group name -> its Purlin Group (what a compiled graph can look up)


def member_ranks(pg) -> list[int]:
    """The global ranks of ``pg``, in group-rank order; an ArgumentError on a rank outside it."""
    if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
        raise ArgumentError(f"rank {dist.get_rank()} is not a member of this group: expected a call on the "
                            f"members of the group only")
    return dist.get_process_group_ranks(pg)


def real_communicator(pg, ranks):
    """A Purlin communicator for ``pg`` on the current CUDA device, and no loader override
    (``purlinc.load``).  ``factory`` names this; tests put a CPU stand-in in its place."""
    from purlinc.runtime.communicator import Communicator

    return Communicator.from_torch(pg), None


factory = real_communicator


def make_group(pg, **load_options):
    """A new :class:`~purlinc.torch.distributed.Group` for process group ``pg`` (a collective of its members)."""
    from purlinc.torch.distributed import Group

    ranks = member_ranks(pg)
    comm, loader = factory(pg, ranks)
    return Group(comm, ranks=ranks, loader=loader, **load_options)


def for_process_group(pg):
    """The cached Purlin Group of ``pg`` (made on first use, by every member of ``pg``)."""
    hit = _GROUPS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    group = make_group(pg)
    _GROUPS[id(pg)] = (pg, group)  # the pg is kept alive with it, so its id is never reused meanwhile
    try:
        _BY_NAME[pg.group_name] = group
    except RuntimeError:  # a group without a name: reachable in compiled code only as a purlinc.torch.Group
        pass
    return group


def made_for(pg):
    """Inside ``torch.compile``: the Purlin Group already made for process group ``pg``, found by
    the group's name (a trace reads that; it cannot make a communicator, which is a collective)."""
    hit = _BY_NAME.get(pg.group_name)
    if hit is None:
        raise ArgumentError(f"group {pg.group_name!r} has no Purlin communicator yet, and a compiled region "
                            f"cannot make one (that is a collective of its members)",
                            notes=("call purlinc.torch.group_of(group) once outside the compiled region "
                                   "(every member of the group), or make one eager call on it first",))
    return hit


def forget(pg) -> None:
    """Drop (and close) the Purlin Group cached for ``pg``."""
    hit = _GROUPS.pop(id(pg), None)
    if hit is not None:
        hit[1].close()
