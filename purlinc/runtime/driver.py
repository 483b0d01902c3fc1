"""A thin wrapper over ``cuda.bindings.driver``: one error checker and the few calls Purlin uses.

Only API present in both cuda-bindings 13.3 and 13.5 is used.  Every binding returns
``(CUresult, *values)``; :func:`call` turns a failure into :class:`CudaError` carrying the
result's name and the driver's explanation, and returns the values otherwise.

Pointers are plain ``int`` everywhere above this module; handles (contexts, modules,
functions, streams, events) are the binding objects.  Nothing here runs at import time,
so importing it needs no GPU (the driver library is loaded by the first call).
"""

from __future__ import annotations

import ctypes
import threading

from cuda.bindings import driver as cu

from purlinc.runtime.errors import CudaError

IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_SUCCESS = cu.CUresult.CUDA_SUCCESS


def describe(result: cu.CUresult) -> str:
    """``NAME: explanation`` for a CUresult (falls back to the enum when the driver can't say)."""
    try:
        err, name = cu.cuGetErrorName(result)
        name = name.decode() if err == _SUCCESS and name else getattr(result, "name", str(result))
        err, text = cu.cuGetErrorString(result)
        text = text.decode() if err == _SUCCESS and text else ""
    except Exception:  # the driver itself may be unusable (that is often why we are here)
        name, text = getattr(result, "name", str(result)), ""
    return f"{name}: {text}" if text else name


def call(fn, *args):
    """Call a binding; raise CudaError on failure; return None, the value, or a tuple of values."""
    out = fn(*args)
    result = out[0] if isinstance(out, tuple) else out
    if result != _SUCCESS:
        raise CudaError(f"{fn.__name__} failed: {describe(result)}", result=result)
    if not isinstance(out, tuple) or len(out) == 1:
        return None
    return out[1] if len(out) == 2 else out[1:]


# ---------------------------------------------------------------------------------------------
# devices and contexts

_init_lock = threading.Lock()
_initialised = False
_contexts: dict[int, cu.CUcontext] = {}


def init() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            try:
                call(cu.cuInit, 0)
            except CudaError:
                raise
            except Exception as error:  # cuda-python found no driver library (a machine without a GPU)
                raise CudaError(f"no CUDA driver could be loaded: {error}") from None
            _initialised = True


def device_count() -> int:
    init()
    return call(cu.cuDeviceGetCount)


def primary_context(device: int) -> cu.CUcontext:
    """The device's primary context (the one torch and CuPy use), retained once per process."""
    init()
    ctx = _contexts.get(device)
    if ctx is None:
        dev = call(cu.cuDeviceGet, device)
        ctx = call(cu.cuDevicePrimaryCtxRetain, dev)
        _contexts[device] = ctx
    return ctx


def set_current(device: int) -> cu.CUcontext:
    ctx = primary_context(device)
    call(cu.cuCtxSetCurrent, ctx)
    return ctx


def compute_capability(device: int) -> tuple[int, int]:
    init()
    dev = call(cu.cuDeviceGet, device)
    attr = cu.CUdevice_attribute
    major = call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return major, minor


def arch_of(device: int) -> str:
    """``sm_90`` for an H200 (sm_90a features are chosen by codegen, not here)."""
    major, minor = compute_capability(device)
    return f"sm_{major}{minor}"


def has_dependent_launch(device: int) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): compute capability 9.0 and newer."""
    return int(arch_of(device).removeprefix("sm_")) >= 90


def device_name(device: int) -> str:
    init()
    dev = call(cu.cuDeviceGet, device)
    raw = call(cu.cuDeviceGetName, 256, dev)
    return raw.split(b"\0", 1)[0].decode()


def sm_count(device: int) -> int:
    """Streaming multiprocessors of ``device``."""
    init()
    dev = call(cu.cuDeviceGet, device)
    return int(call(cu.cuDeviceGetAttribute, cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))


def can_access_peer(device: int, peer: int) -> bool:
    init()
    dev, other = call(cu.cuDeviceGet, device), call(cu.cuDeviceGet, peer)
    return bool(call(cu.cuDeviceCanAccessPeer, dev, other))


def enable_peer_access(device: int, peer: int) -> None:
    """Let ``device``'s context reach ``peer``'s memory (idempotent)."""
    set_current(device)
    result, = cu.cuCtxEnablePeerAccess(primary_context(peer), 0)
    if result not in (_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        raise CudaError(f"cuCtxEnablePeerAccess({device} -> {peer}) failed: {describe(result)}", result=result)


def synchronize(device: int) -> None:
    set_current(device)
    call(cu.cuCtxSynchronize)


# ---------------------------------------------------------------------------------------------
# memory

def mem_alloc(nbytes: int) -> int:
    return int(call(cu.cuMemAlloc, max(int(nbytes), 1)))


def mem_free(ptr: int) -> None:
    call(cu.cuMemFree, ptr)


def host_alloc_mapped(nbytes: int) -> tuple[int, int]:
    """Pinned host memory the device can write: (host pointer, device pointer).

    Used for error records: the host reads them with a plain load, no synchronisation.
    """
    flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
    host = int(call(cu.cuMemHostAlloc, nbytes, flags))
    ctypes.memset(host, 0, nbytes)
    device = int(call(cu.cuMemHostGetDevicePointer, host, 0))
    return host, device


def host_free(host_ptr: int) -> None:
    call(cu.cuMemFreeHost, host_ptr)


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation that contains ``ptr``."""
    base, size = call(cu.cuMemGetAddressRange, ptr)
    return int(base), int(size)


def pointer_device(ptr: int) -> int:
    """The device ordinal that owns a device pointer (raises for host memory)."""
    init()
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(call(cu.cuPointerGetAttribute, attr, ptr))


def memset_d8(ptr: int, value: int, nbytes: int, stream: int = 0) -> None:
    call(cu.cuMemsetD8Async, ptr, value, nbytes, stream)


def copy_htod(dst: int, data: bytes) -> None:
    buf = ctypes.create_string_buffer(data, len(data))
    call(cu.cuMemcpyHtoD, dst, ctypes.addressof(buf), len(data))


def copy_dtoh(src: int, nbytes: int) -> bytes:
    buf = ctypes.create_string_buffer(nbytes)
    call(cu.cuMemcpyDtoH, ctypes.addressof(buf), src, nbytes)
    return buf.raw


def memcpy_async(dst: int, src: int, nbytes: int, stream) -> None:
    """Stream-ordered copy; peer pointers go over NVLink on the copy engines (UVA)."""
    call(cu.cuMemcpyAsync, dst, src, nbytes, stream)


# ---------------------------------------------------------------------------------------------
# IPC

def ipc_handle(ptr: int) -> tuple[bytes, int]:
    """(handle bytes, offset of ``ptr`` inside its allocation).

    A handle names the whole underlying allocation, so sub-allocated memory (a caching
    allocator's block) is exported as base + offset.
    """
    base, _ = address_range(ptr)
    handle = call(cu.cuIpcGetMemHandle, base)
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES), ptr - base


def ipc_open(handle: bytes, offset: int = 0) -> int:
    """Map a peer's allocation here; returns the pointer at ``offset`` inside it."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
    flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    base = int(call(cu.cuIpcOpenMemHandle, h, flags))
    return base + offset


def ipc_close(base: int) -> None:
    call(cu.cuIpcCloseMemHandle, base)


# ---------------------------------------------------------------------------------------------
# modules and launches

def module_load(cubin: bytes) -> cu.CUmodule:
    return call(cu.cuModuleLoadData, cubin)


def module_unload(module: cu.CUmodule) -> None:
    call(cu.cuModuleUnload, module)


def get_function(module: cu.CUmodule, name: str) -> cu.CUfunction:
    return call(cu.cuModuleGetFunction, module, name.encode())


def set_max_dynamic_shared(function: cu.CUfunction, nbytes: int) -> None:
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    call(cu.cuFuncSetAttribute, function, attr, nbytes)


def local_bytes(function: cu.CUfunction) -> int:
    """Local memory (stack) each thread of ``function`` needs, in bytes."""
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
    return int(call(cu.cuFuncGetAttribute, attr, function))


def blocks_per_sm(function: cu.CUfunction, threads: int, shared: int) -> int:
    """How many blocks of ``function`` (``threads`` each, ``shared`` dynamic shared bytes) one
    SM holds at once, by its registers, shared memory and threads."""
    return int(call(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor, function, threads, shared))


def stack_limit() -> int:
    """The current context's per-thread stack size, in bytes."""
    return int(call(cu.cuCtxGetLimit, cu.CUlimit.CU_LIMIT_STACK_SIZE))


def reserve_stack(nbytes: int) -> None:
    """Grow the current context's per-thread stack to at least ``nbytes`` now.

    A launch whose kernel needs more stack than the context has grows it itself, and growing
    it waits until every kernel already running on the device has finished (cuCtxSetLimit).
    Ranks that share a GPU (a loopback group) launch one after another and each waits for the
    others' signals, so that wait would last until the first rank's waits timed out: the stack
    a group call needs is reserved before any rank launches (``Collective.variant``)."""
    if nbytes > stack_limit():
        set_stack_limit(nbytes)


def set_stack_limit(nbytes: int) -> None:
    call(cu.cuCtxSetLimit, cu.CUlimit.CU_LIMIT_STACK_SIZE, int(nbytes))


class PackedArgs:
    """One kernel argument (a struct by value) kept alive with its ``void*[1]`` array.

    ``kernel_params`` is the address cuLaunchKernel wants: an array of one pointer to
    the struct bytes.  Both ctypes buffers live as long as this object.  ``config``: a
    :class:`DependentLaunch` when the launch is to be a programmatic dependent one, else None.
    """

    __slots__ = ("buffer", "pointers", "kernel_params", "config")

    def __init__(self, data: bytes, config: "DependentLaunch | None" = None):
        self.buffer = ctypes.create_string_buffer(data, len(data))
        self.pointers = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))
        self.kernel_params = ctypes.addressof(self.pointers)
        self.config = config


class DependentLaunch:
    """A launch configuration with programmatic dependent launch (sm_90+): the kernel may be
    scheduled before the kernel ahead of it in the stream has finished, and must wait for it
    on the device (``griddepcontrol.wait``, templates/prelude.cuh: purlin_launch_order) before
    it touches memory; so its launch latency overlaps the previous kernel instead of following
    it.  Stream capture records the dependency as a programmatic graph edge."""

    __slots__ = ("config",)

    def __init__(self, grid: int, block: int, shared: int):
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes = shared
        config.attrs = [attr]
        config.numAttrs = 1
        self.config = config


_launch = cu.cuLaunchKernel
_launch_ex = cu.cuLaunchKernelEx


def launch(function, grid: int, block: int, shared: int, stream, args: PackedArgs) -> None:
    """cuLaunchKernel with one by-value struct argument (hot path: no allocation), or
    cuLaunchKernelEx with ``args.config`` (the same grid, block and shared bytes) when set.

    (Calling libcuda through ctypes instead was measured on the H200 host, 2026-11-29: 23.3 us
    of host time per eager call against 20.4 us through the binding, so the binding stays.)
    """
    if isinstance(function, int):
        function = cu.CUfunction(function)
    dependent = args.config
    if dependent is not None:
        config = dependent.config
        config.hStream = stream
        result, = _launch_ex(config, function, args.kernel_params, 0)
        if result != _SUCCESS:
            raise CudaError(f"cuLaunchKernelEx failed: {describe(result)}", result=result)
        return
    result, = _launch(function, grid, 1, 1, block, 1, 1, shared, stream, args.kernel_params, 0)
    if result != _SUCCESS:
        raise CudaError(f"cuLaunchKernel failed: {describe(result)}", result=result)


# ---------------------------------------------------------------------------------------------
# streams, events, stream memory operations (the ce atom)

def stream_create() -> cu.CUstream:
    return call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING)


def stream_capturing(stream) -> bool:
    """Whether ``stream`` (a handle or raw int) is being captured into a CUDA graph.  The legacy
    default stream, asked while another stream captures, is not (the driver refuses the query
    with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT; a launch there would be refused the same way)."""
    result, status = cu.cuStreamIsCapturing(stream)
    if result == cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
        return False
    if result != _SUCCESS:
        raise CudaError(f"cuStreamIsCapturing failed: {describe(result)}", result=result)
    return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


CAPTURE_MODE_RELAXED = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED


def exchange_capture_mode(mode):
    """Set this thread's stream-capture mode; returns the previous one (to restore it)."""
    return call(cu.cuThreadExchangeStreamCaptureMode, mode)


def stream_destroy(stream) -> None:
    call(cu.cuStreamDestroy, stream)


def stream_synchronize(stream) -> None:
    call(cu.cuStreamSynchronize, stream)


def event_create() -> cu.CUevent:
    return call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)


def event_destroy(event) -> None:
    call(cu.cuEventDestroy, event)


def event_record(event, stream) -> None:
    call(cu.cuEventRecord, event, stream)


def stream_wait_event(stream, event) -> None:
    call(cu.cuStreamWaitEvent, stream, event, 0)


_WRITE_DEFAULT = cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT  # fence before the write
_WAIT_GEQ = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ


def write_value64(stream, addr: int, value: int) -> None:
    """Stream-ordered store of ``value`` at ``addr`` (after a fence: earlier copies are visible)."""
    call(cu.cuStreamWriteValue64, stream, addr, value, _WRITE_DEFAULT)


def wait_value64(stream, addr: int, value: int) -> None:
    """Block ``stream`` until ``*(u64*)addr >= value`` (no timeout: the copy engines have none)."""
    call(cu.cuStreamWaitValue64, stream, addr, value, _WAIT_GEQ)


def supports_stream_mem_ops(device: int) -> bool:
    init()
    dev = call(cu.cuDeviceGet, device)
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    return bool(call(cu.cuDeviceGetAttribute, attr, dev))
