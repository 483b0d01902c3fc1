"""Setting up the systems: torch symmetric memory, NCCL symmetric windows, Purlin (precompile,
communicator, loads) and purlin/hierarchical."""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

import purlin_api
import report
from benchlib.cases import hier_variant
from benchlib.context import Ctx, barrier, guarded
from benchlib.plan import HIER


def setup_symm(ctx: Ctx, nbytes: int) -> None:
    def body():
        import torch.distributed._symmetric_memory as symm_mem

        try:
            with warnings.catch_warnings():  # needed by older torch; deprecated (a no-op) in newer
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(ctx.group_name)
        except Exception:  # noqa: BLE001
            pass
        S = symm_mem.empty(max(nbytes // 2, 8), dtype=torch.bfloat16, device=ctx.device)
        handle = symm_mem.rendezvous(S, ctx.group_name)
        return S, handle

    ran, value, err = guarded(ctx, body)
    ctx.symm = value if ran else None
    ctx.meta["symm_mem"] = {"buffer_bytes": nbytes} if ran else {"error": err}
    ctx.log(f"symm_mem buffer {report.fmt_bytes(nbytes)}: {'ok' if ran else err}")


def setup_nccl_symm(ctx: Ctx, in_bytes: int, out_bytes: int) -> None:
    """Two flat bf16 buffers registered with NCCL as symmetric windows, so that ordinary
    dist.all_reduce / all_gather_into_tensor / reduce_scatter_tensor on views of them take
    NCCL's symmetric kernels.  Two ways (torch 2.11, NCCL 2.28), tried in order; the one that
    worked, or why neither did, goes into meta.nccl_symm (a failure never stops the run)."""
    n_in, n_out = max(in_bytes // 2, 8), max(out_bytes // 2, 8)
    tried = {}

    def via_symm_mem():
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NCCL")
        SX = symm_mem.empty(n_in, dtype=torch.bfloat16, device=ctx.device)
        SY = symm_mem.empty(n_out, dtype=torch.bfloat16, device=ctx.device)
        symm_mem.rendezvous(SX, ctx.group_name)
        symm_mem.rendezvous(SY, ctx.group_name)
        return SX, SY

    def via_mem_pool():
        backend = dist.group.WORLD._get_backend(ctx.device)
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            SX = torch.empty(n_in, dtype=torch.bfloat16, device=ctx.device)
            SY = torch.empty(n_out, dtype=torch.bfloat16, device=ctx.device)
        try:
            backend.register_mem_pool(pool, symm=True)
        except TypeError as e:  # no symm= in this torch: plain registration is not what we measure
            raise RuntimeError(f"register_mem_pool(pool, symm=True) unsupported: {e}") from e
        ctx.meta.setdefault("_keep", []).append(pool)  # the pool must outlive the buffers
        return SX, SY

    for name, how in (("symm_mem.set_backend('NCCL') + symm_mem.empty + rendezvous", via_symm_mem),
                      ("MemPool(backend.mem_allocator) + register_mem_pool(symm=True)", via_mem_pool)):
        ran, value, err = guarded(ctx, how)
        if ran:
            ctx.nsymm = value
            ctx.meta["nccl_symm"] = {"method": name, "in_bytes": in_bytes, "out_bytes": out_bytes,
                                     **({"failed_first": tried} if tried else {})}
            ctx.log(f"NCCL symmetric buffers: {name}")
            return
        tried[name] = err
    ctx.meta["nccl_symm"] = {"error": "; ".join(f"{k}: {v}" for k, v in tried.items())[:2000]}
    ctx.log(f"NCCL symmetric buffers unavailable: {ctx.meta['nccl_symm']['error'][:300]}")


def precompile(ctx: Ctx) -> None:
    """Warm Purlin's on-disk compile cache with a process pool on one rank per host."""
    plan = ctx.plan
    jobs = purlin_api.precompile_jobs(plan.collectives, plan.variants if "purlin" in plan.systems else (), ctx.world)
    if HIER in plan.systems:
        jobs += purlin_api.hier_precompile_jobs(plan.collectives, plan.hier, ctx.world)
    info = {"jobs": len(jobs)}
    if ctx.local_rank == 0 and jobs:
        import concurrent.futures as cf
        import multiprocessing as mp

        major, minor = torch.cuda.get_device_capability(ctx.device)
        arch = f"sm_{major}{minor}"
        t = time.time()
        done, failed = 0, []
        pool = cf.ProcessPoolExecutor(max_workers=max(1, min(ctx.args.precompile_workers, len(jobs))),
                                      mp_context=mp.get_context("spawn"))
        try:
            futs = {pool.submit(purlin_api.precompile_one, j, arch): j for j in jobs}
            for f in cf.as_completed(futs, timeout=ctx.args.precompile_timeout_s):
                try:
                    f.result()
                    done += 1
                except Exception as e:  # noqa: BLE001
                    j = futs[f]
                    failed.append(f"{j['collective']}/{j['variant']}: {type(e).__name__}: {str(e)[:200]}")
        except Exception as e:  # noqa: BLE001 - a pool failure (or timeout) only loses the warm-up
            failed.append(f"pool: {type(e).__name__}: {e}")
        finally:
            # Never wait for a stuck worker: cancel what is queued, stop what runs.
            workers = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for w in workers:
                if w.is_alive():
                    w.terminate()
        info.update(arch=arch, compiled=done, failed=failed[:20], seconds=round(time.time() - t, 1))
        ctx.log(f"precompile: {done}/{len(jobs)} compiled in {info['seconds']} s"
                + (f", {len(failed)} failed (first: {failed[0]})" if failed else ""))
    barrier(ctx)
    ctx.meta["precompile"] = info


def setup_purlin(ctx: Ctx) -> None:
    free0 = torch.cuda.mem_get_info(ctx.device)[0]
    heap = purlin_api.heap_bytes_for(ctx.plan.loads())
    ctx.meta["purlin_heap"] = {"heap_bytes": heap or "PURLIN_HEAP_MB", "stage_bytes_per_collective":
                               purlin_api.stage_bytes(), "loads": ctx.plan.loads()}
    ran, comm, err = guarded(ctx, lambda: purlin_api.communicator(heap))
    if not ran:
        ctx.meta["purlin_error"] = f"Communicator.from_torch: {err}"
        ctx.log(f"Purlin communicator failed: {err}")
        for coll in ctx.plan.collectives:
            for v in ctx.plan.variants:
                if v.applies(coll):
                    ctx.add(_load_error_row(ctx, coll, v, f"communicator: {err}"))
        return
    ctx.comm = comm
    free1 = torch.cuda.mem_get_info(ctx.device)[0]
    load_times = {}
    for coll in ctx.plan.collectives:
        shared: dict = {}  # load_key -> loaded (zerocopy uses the default's collective)
        for v in ctx.plan.variants:
            if not v.applies(coll):
                continue
            key = purlin_api.load_key(v)
            if key in shared:
                ctx.colls[(coll, v.name)] = shared[key]
                continue
            t = time.time()
            ran, loaded, err = guarded(ctx, lambda: purlin_api.load(comm, coll, v.options))
            load_times[f"{coll}/{v.name}"] = round(time.time() - t, 2)
            if ran:
                ctx.colls[(coll, v.name)] = shared[key] = loaded
            else:
                ctx.add(_load_error_row(ctx, coll, v, f"load: {err}"))
    free2 = torch.cuda.mem_get_info(ctx.device)[0]
    ctx.meta["purlin_load_s"] = load_times
    ctx.meta["purlin_footprint"] = {"after_communicator": free0 - free1, "after_loads": free0 - free2,
                                    **purlin_api.device_bytes(comm)}
    ctx.log(f"Purlin: {len(ctx.colls)} collectives loaded in {sum(load_times.values()):.1f} s "
            f"({sum(1 for r in ctx.rows if r.get('phase') == 'load')} failed)")


def setup_hierarchical(ctx: Ctx) -> None:
    """Load every collective as purlin/hierarchical for each gpus_per_node of the plan (every
    rank, same order: each load is a collective).  A load that fails (no plan, a topology
    error) becomes one error row, and that variant is skipped for that collective."""
    load_times = {}
    for coll in ctx.plan.collectives:
        for g in ctx.plan.hier:
            t = time.time()
            ran, loaded, err = guarded(ctx, lambda: purlin_api.load_hierarchical(coll, g))
            load_times[f"{coll}/{hier_variant(g)}"] = round(time.time() - t, 2)
            if ran:
                ctx.hcolls[(coll, g)] = loaded
            else:
                ctx.add({"system": HIER, "variant": hier_variant(g), "collective": coll, "dtype": "bfloat16",
                         "bytes": None, "world_size": ctx.world, "mode": None, "time_us": None, "checked": None,
                         "options": {"gpus_per_node": g}, "error": f"load: {err}", "phase": "load"})
    ctx.meta["hier_load_s"] = load_times
    ctx.log(f"{HIER}: {len(ctx.hcolls)} of {ctx.plan.hier_loads()} loaded in {sum(load_times.values()):.1f} s")


def _load_error_row(ctx: Ctx, coll: str, v: purlin_api.Variant, err: str) -> dict:
    return {"system": "purlin", "variant": v.name, "collective": coll, "dtype": "bfloat16", "bytes": None,
            "world_size": ctx.world, "mode": None, "time_us": None, "checked": None, "options": v.options or None,
            "error": err, "phase": "load"}
