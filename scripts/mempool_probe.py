"""Diagnose comm.mem_pool on a GPU machine: does torch route a MemPool's allocations to
Purlin's pluggable allocator?  Prints what it sees; exits 0 either way (a probe, not a test)."""

import os

import torch

import purlinc
from purlinc.runtime.communicator import LocalGroup

print("torch", torch.__version__, "PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
group = LocalGroup([0])
comm = group.comms[0] if hasattr(group, "comms") else group[0]
pool = comm.mem_pool(64 << 20)
region = pool.purlin_region
print("pool id", pool.id, "allocator", getattr(pool, "allocator", None), "region", hex(region.block.ptr))
for label, nbytes in (("small", 1 << 17), ("large", 8 << 20)):
    with torch.cuda.device(0), torch.cuda.use_mem_pool(pool):
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    inside = region.block.ptr <= t.data_ptr() < region.block.ptr + region.block.nbytes
    print(label, hex(t.data_ptr()), "inside heap region:", inside, "calls", region.calls, "failed", region.failed)
try:
    print("pool snapshot segments:", len(pool.snapshot()))
except Exception as error:  # noqa: BLE001
    print("snapshot:", type(error).__name__, error)
