"""The eight standard collectives as .pln text, carried inside the package (``examples/``
is not installed).  A test checks each against ``examples/<name>.pln``.  purlinc.torch maps
torch.distributed's calls onto them; the runtime's measured tuning tables are theirs
(``runtime.tuning``)."""

from __future__ import annotations

SOURCES: dict[str, str] = {
    "allreduce": "collective allreduce { in[r] = x[0..R]  out[r] = x[0..R]  reduce }",
    "allgather": "collective allgather { in[r] = x[r]  out[r] = x[0..R]  copy }",
    "reduce_scatter": "collective reduce_scatter { in[r] = x[0..R]  out[r] = x[r]  reduce }",
    "alltoall": "collective alltoall { in[r] = x[r][0..R]  out[r] = x[0..R][r]  copy }",
    "broadcast": "collective broadcast(root = 0) { in[root] = x  out[r] = x  copy }",
    "reduce": "collective reduce(root = 0) { in[r] = x  out[root] = x  reduce }",
    "gather": "collective gather(root = 0) { in[r] = x[r]  out[root] = x[0..R]  copy }",
    "scatter": "collective scatter(root = 0) { in[root] = x[0..R]  out[r] = x[r]  copy }",
}

ROOTED = ("broadcast", "reduce", "gather", "scatter")  # take a ``root`` parameter
