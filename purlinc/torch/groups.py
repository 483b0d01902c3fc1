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

import torch
import torch.distributed as dist

from purlinc.runtime.errors import ArgumentError
from purlinc.torch import ops as _ops
from purlinc.torch.distributed import Group

# Process group classes whose shutdown releases what Purlin made for them (``forget``): the
# purlin backend's, which names itself (backend.py imports this module, not the reverse).
_SELF_RELEASING: tuple[type, ...] = ()


def releases_itself(cls: type) -> None:
    """Say that ``cls``'s process groups call :func:`forget` when torch destroys them."""
    global _SELF_RELEASING
    _SELF_RELEASING = (*_SELF_RELEASING, cls)


_GROUPS: dict[int, tuple[object, object]] = {}  # id(process group) -> (the group, its Purlin Group)
# process group name -> (the group, its Purlin Group): what a compiled graph can look up.  The
# group is kept beside it for an identity test a trace can make (`is`: dynamo before torch 2.13
# cannot trace id() of a ProcessGroup).
_BY_NAME: dict[str, tuple[object, object]] = {}


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

    _require_cuda(pg)
    return Communicator.from_torch(pg), None


def _require_cuda(pg) -> None:
    """A Purlin communicator lives on a CUDA device: without one, say so before anything is
    exchanged (every rank refuses alike), where torch.cuda.init() deep in the communicator raised
    "Torch not compiled with CUDA enabled" (an AssertionError) or "No CUDA GPUs are available"."""
    if torch.cuda.is_available():
        return
    why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    try:
        name = pg.group_name
    except RuntimeError:  # a group without a name
        name = "?"
    raise ArgumentError(f"group {name!r}: a Purlin communicator needs a CUDA device, and {why} "
                        f"(torch.cuda.is_available() is False)",
                        notes=("on the purlin backend, CPU tensors go to its CPU fallback (gloo); purlinc.torch's "
                               "own calls and pt.functional need CUDA tensors",))


factory = real_communicator


def make_group(pg, **load_options):
    """A new :class:`~purlinc.torch.distributed.Group` for process group ``pg`` (a collective of its members)."""
    ranks = member_ranks(pg)
    comm, loader = factory(pg, ranks)
    return Group(comm, ranks=ranks, loader=loader, **load_options)


def for_process_group(pg):
    """The cached Purlin Group of ``pg`` (made on first use, by every member of ``pg``)."""
    hit = _GROUPS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    release_destroyed()  # a new group is rare: the moment to drop those torch has destroyed
    group = make_group(pg)
    _GROUPS[id(pg)] = (pg, group)  # the pg is kept alive with it, so its id is never reused meanwhile
    try:
        _BY_NAME[pg.group_name] = (pg, group)
    except RuntimeError:  # a group without a name: reachable in compiled code only as a purlinc.torch.Group
        pass
    return group


def made_for(pg):
    """Inside ``torch.compile``: the Purlin Group already made for process group ``pg``, found by
    the group's name (a trace reads that; it cannot make a communicator, which is a collective)."""
    hit = _BY_NAME.get(pg.group_name)
    # A name torch gave again after a destroy must not find the old group.  Compared here, not
    # released (release_destroyed): closing a group takes locks, which dynamo cannot enter, and
    # freeing a communicator has no place in a trace; the next eager call releases it.  Where
    # both are groups of the purlin backend the entry is this group's: such a group leaves the
    # map at its shutdown, and live groups' names are unique.  They are not compared with `is`:
    # dynamo before torch 2.13 wraps that subclass two ways, and `is` between them is False.
    stale = hit is not None and hit[0] is not pg and not (
        isinstance(pg, _SELF_RELEASING) and isinstance(hit[0], _SELF_RELEASING))
    if hit is None or stale:  # fail, not raise: dynamo cannot build an ArgumentError (see ops.fail)
        _ops.fail(f"group {pg.group_name!r} has no Purlin communicator yet, and a compiled region cannot make one "
                  f"(that is a collective of its members)",
                  notes=("call purlinc.torch.group_of(group) once outside the compiled region (every member of the "
                         "group), or make one eager call on it first",))
    return hit[1]


def forget(pg) -> None:
    """Drop and close what was made for ``pg``: its Purlin Group (its loaded collectives) and
    the communicator made for it (its symmetric heap and peer mappings).  Nothing to do for a
    group never used with Purlin."""
    hit = _GROUPS.get(id(pg))
    if hit is None or hit[0] is not pg:
        return
    del _GROUPS[id(pg)]
    group = hit[1]
    for name in [name for name, (_, g) in _BY_NAME.items() if g is group]:
        del _BY_NAME[name]
    group.close()
    close = getattr(group.comm, "close", None)
    if close is not None:
        close()


def _registered(pg) -> bool:
    """Whether torch still knows ``pg`` (``destroy_process_group`` unregisters it; a process
    group of the ``purlin`` backend is released by its own ``shutdown`` then)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = getattr(world, "pg_map", None)
    return True if groups is None else pg in groups


def release_destroyed() -> None:
    """Release what was made for the process groups torch has destroyed since (``forget``):
    the cache keeps them alive, so without this their communicators would stay."""
    for pg, _ in list(_GROUPS.values()):
        if not _registered(pg):
            forget(pg)



# The default group of the module-level calls (purlinc.torch.all_reduce, purlinc.torch.functional),
# kept beside the process-group map so that the functional forms need not import the package.
_DEFAULT: list[Group] = []


def init(comm, **load_options) -> Group:
    """Make ``Group(comm, **load_options)`` the default of the module-level calls, and return it.
    A Group is taken as it is: options beside it would go unread, so they are refused."""
    if isinstance(comm, Group) and load_options:
        raise ArgumentError(f"init: load options ({', '.join(sorted(load_options))}) beside a Group: the group was "
                            "made with its own; pass a communicator, or make the Group with them")
    group = comm if isinstance(comm, Group) else Group(comm, **load_options)
    _DEFAULT[:] = [group]
    return group


def default_group() -> Group:
    if not _DEFAULT:
        raise ArgumentError("no default Purlin group: call purlinc.torch.init(comm) first, or pass group=")
    return _DEFAULT[0]


def group_of(group=None) -> Group:
    """The Purlin Group that ``group=`` names: a :class:`Group` itself; a torch ProcessGroup
    (``WORLD``, ``new_group``'s, a DeviceMesh dimension's, the ``purlin`` backend's) through
    :mod:`purlinc.torch.groups` (made on first use, collectively, and cached); ``None``: the
    group of :func:`init`, else torch.distributed's default group."""
    if isinstance(group, Group):
        return group
    if group is None:
        if _DEFAULT:
            return _DEFAULT[0]
        if not (dist.is_available() and dist.is_initialized()):  # (traced too: ops.fail)
            _ops.fail("no default Purlin group: call purlinc.torch.init(comm) or torch.distributed.init_process_group "
                      "first, or pass group=")
        group = dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):  # checked first: traced, anything else has no group_name to read
        if torch.compiler.is_compiling():  # a trace cannot make a communicator (a collective): find the one made
            return made_for(group)
        purlin = getattr(group, "purlin_group", None)  # a process group of the purlin backend
        return purlin() if purlin is not None else for_process_group(group)
    _ops.fail(f"group={_ops.value_shown(group)}: expected a purlinc.torch.Group or a torch.distributed ProcessGroup")
