"""Expert-parallel dispatch and combine for mixture-of-experts layers, on the all-to-all with
run-time sizes (docs/LANGUAGE.md, "Run-time sizes"; ``examples/sized/alltoallv.pln``).

    disp = Dispatcher(coll, rank=r, world_size=R, num_experts=E, hidden=H, top_k=k, max_tokens=T)
    got = disp.dispatch(x, topk_ids, topk_weights)       # x [T, H]; ids [T, k] int; weights [T, k]
    partial = expert_weighted_sum(got, experts)           # [N, H]: this rank's experts, weighted
    y = disp.combine(partial)                             # [T, H]: sum_j w[t, j] * expert_{ids[t, j]}(x[t])

Expert ``e`` lives on rank ``e // (E / R)``.  Dispatch sends each token once to every rank that
holds one of its top-k experts (not once per expert), with the token's top-k expert ids
(local to that rank, -1 for experts elsewhere) and weights in the same row; the receiving
rank gets the rows packed by source rank.  Combine sends every row's partial result (the
weighted sum over that rank's experts) back to where it came from, and each token's rank adds
its partials up: the weighted sum in the original token order.

Nothing synchronises with the host: the routing (who goes where, in which order) is computed
with fixed-shape tensor operations, the split sizes stay on the GPU, and buffers are sized
by ``max_tokens`` (a rank receives at most ``max_tokens`` rows from each rank), so a whole
dispatch + experts + combine step can be captured in one CUDA graph and replayed with new
routings.

``coll`` is this rank's loaded all-to-all with run-time sizes: ``purlinc.load(SOURCE, comm,
capacity=capacity_for(...))`` (a Communicator's, or one rank of a LocalGroup's), or
:func:`dispatchers` builds every rank's for a LocalGroup.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

try:
    import torch
except ModuleNotFoundError as error:  # the [torch] extra, as for purlinc.torch
    if error.name != "torch":
        raise
    raise ModuleNotFoundError("purlinc.moe needs PyTorch: pip install 'purlinc[torch]' (or torch itself)",
                              name="torch") from None

from purlinc.runtime.errors import ArgumentError

SOURCE = "collective alltoallv with sizes n[R][R] of x { in[r] = x[r][0..R]  out[r] = x[0..R][r]  copy }"
META_BYTES = 8  # per top-k slot in a row: its local expert id (int32) and its weight (float32)


def row_elements(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """Elements of one dispatched row: the token, then its top-k ids and weights as raw bytes."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if (META_BYTES * top_k) % itemsize:
        raise ArgumentError(f"top_k={top_k}: {META_BYTES * top_k} bytes of ids and weights per row do not fill "
                            f"whole {itemsize}-byte elements")
    return hidden + META_BYTES * top_k // itemsize


def capacity_for(hidden: int, top_k: int, max_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The all-to-all capacity (elements per rank pair) dispatch and combine need: at most
    ``max_tokens`` rows from one rank to another, each ``row_elements`` wide."""
    hidden, top_k, max_tokens = (_at_least(label, value, 1, where="capacity_for")  # a capacity of 0 loads nothing
                                 for label, value in (("hidden", hidden), ("top_k", top_k), ("max_tokens", max_tokens)))
    _exchange_dtype("capacity_for", dtype)  # only what a Dispatcher takes
    return max_tokens * row_elements(hidden, top_k, dtype)


@dataclass
class Dispatched:
    """What a rank receives: rows packed by source rank, ``counts[s]`` of them from rank ``s``
    (on the GPU).  Rows past the received ones hold stale data, expert ids -1 and weights 0."""

    tokens: torch.Tensor  # [N, H], N = R * max_tokens (a view into the receive buffer)
    expert_ids: torch.Tensor  # [N, k] int32: local expert of each top-k slot, -1 if elsewhere
    weights: torch.Tensor  # [N, k] float32: 0 where expert_ids is -1
    counts: torch.Tensor  # [R] int64
    rows: torch.Tensor  # [] int64: rows received (counts.sum())


def _at_least(label: str, value, low: int, *, where: str = "Dispatcher") -> int:
    """``value`` as a Python int of at least ``low`` (a NumPy integer too: a config read from an
    array is one); a bool or a float is refused, as nobody means a size by them."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise ArgumentError(f"{where}: {label}={value!r}, expected an int >= {low}")
    return int(value)


def _float_dtype(where: str, label: str, dtype) -> None:
    """A floating torch.dtype: combine sums partials in float32 and scales by the routing
    weights, so an integer dtype would round its values there without a word."""
    if not isinstance(dtype, torch.dtype):
        raise ArgumentError(f"{where}: {label}={dtype!r} ({type(dtype).__name__}), expected a torch.dtype such as "
                            "torch.bfloat16")
    if not dtype.is_floating_point or dtype.is_complex:
        raise ArgumentError(f"{where}: {label}={str(dtype).removeprefix('torch.')}, expected a floating dtype "
                            "(combine sums the experts' partials in float32 and weighs them)")


def _exchange_dtype(where: str, dtype) -> None:
    """A dtype the exchange carries: floating (``_float_dtype``) and one the all-to-all moves
    (warm() loads that dtype's kernel); the refusal lists only dtypes that are both."""
    from purlinc.runtime.interop import _torch_dtype_map

    _float_dtype(where, "dtype", dtype)
    if dtype not in _torch_dtype_map():
        names = ", ".join(str(d).removeprefix("torch.") for d in _torch_dtype_map()
                          if d.is_floating_point and not d.is_complex)
        raise ArgumentError(f"{where}: dtype={dtype}, expected one of {names}")


def _tensors(where: str, named, device) -> None:
    """Each ``(label, value)`` a torch.Tensor on the Dispatcher's device, checked before anything
    reads it: a list has no tensor methods, and a tensor on another device would fail inside the
    routing, in torch's words (a CPU x indexed by rows on the GPU)."""
    for label, t in named:
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ArgumentError(f"{where}: {label} is on {t.device}, expected {device} (the device of this "
                                "Dispatcher's buffers)")
        if t.requires_grad and torch.is_grad_enabled():
            # The exchange has no backward: the result came out detached, while the persistent
            # send buffer joined the graph and kept the input alive between steps.
            raise ArgumentError(f"{where}: {label} requires grad, but dispatch and combine have no gradient; "
                                "expected a tensor without one (run the step under torch.no_grad(), or pass "
                                f"{label}.detach())")


def _check_shape(rank, world_size, num_experts, hidden, top_k, max_tokens, dtype) -> tuple[int, ...]:
    """The sizes the buffers and the routing are built from, before anything is allocated:
    (rank, world_size, num_experts, hidden, top_k, max_tokens) as Python ints."""
    # max_tokens >= 1: the capacity is max_tokens rows per pair, and a load refuses a capacity of 0
    world_size, num_experts, hidden, top_k, max_tokens = (
        _at_least(label, value, 1) for label, value in (("world_size", world_size), ("num_experts", num_experts),
                                                         ("hidden", hidden), ("top_k", top_k),
                                                         ("max_tokens", max_tokens)))
    rank = _at_least("rank", rank, 0)
    if rank >= world_size:
        raise ArgumentError(f"Dispatcher: rank={rank}, expected a rank in [0, {world_size})")
    if num_experts % world_size:  # expert e lives on rank e // (E / R): every rank holds as many
        raise ArgumentError(f"Dispatcher: num_experts={num_experts} does not split over world_size={world_size} "
                            "ranks; expected a multiple of it (every rank holds as many experts)")
    if top_k > num_experts:  # a token's top-k experts are distinct
        raise ArgumentError(f"Dispatcher: top_k={top_k}, expected at most num_experts={num_experts}")
    _exchange_dtype("Dispatcher", dtype)
    return rank, world_size, num_experts, hidden, top_k, max_tokens


def _check_capacity(coll, hidden: int, top_k: int, max_tokens: int, dtype) -> None:
    """The collective carries ``max_tokens`` rows per rank pair: rows past its capacity would be
    moved as size 0 (tokens lost for that step) and reported only by the next exchange."""
    capacity = getattr(coll, "capacity", None)
    need = capacity_for(hidden, top_k, max_tokens, dtype)
    if isinstance(capacity, int) and capacity < need:
        raise ArgumentError(f"Dispatcher: the collective's capacity is {capacity} elements per rank pair, expected "
                            f"at least {need} (max_tokens={max_tokens} rows of {row_elements(hidden, top_k, dtype)} "
                            "elements: moe.capacity_for(hidden, top_k, max_tokens, dtype))",
                            notes=("load it with capacity=moe.capacity_for(...), or use moe.dispatchers",))


def _same_group(coll, rank: int, world_size: int) -> None:
    """``rank`` and ``world_size`` are the loaded collective's own (where it says): a Dispatcher
    told another rank would route as that rank and receive as this one."""
    comm = getattr(coll, "comm", None)
    own_rank, own_world = getattr(coll, "rank", rank), getattr(comm, "world_size", world_size)
    if (own_rank, own_world) != (rank, world_size):
        raise ArgumentError(f"Dispatcher: rank={rank}, world_size={world_size}, but the collective is rank {own_rank} "
                            f"of {own_world}")


def _device_of(coll, device):
    """The Dispatcher's device: the collective's own GPU (where it says), which ``device=`` may
    name but not contradict; buffers elsewhere failed at the first dispatch, in the runtime's
    words about an internal send buffer."""
    own = getattr(coll, "device", None)
    if not isinstance(own, int) or isinstance(own, bool):
        return device  # a stand-in without a device (tests): as given
    given = None if device is None else torch.device(device)
    if given is not None and (given.type != "cuda" or given.index not in (None, own)):
        raise ArgumentError(f"Dispatcher: device={device!r}, but the collective runs on cuda:{own}",
                            notes=("leave device= out: the Dispatcher takes the collective's",))
    return torch.device("cuda", own)  # "cuda" (the current device) is the collective's too


def _agree(coll, sizes: dict) -> None:
    """Under torchrun, every rank's sizes are the same (a host-side exchange, once per
    Dispatcher): a rank built with a larger ``max_tokens`` or another ``hidden`` or ``top_k``
    would send rows its peers' buffers do not hold, and the exchange would report that only on
    the GPU, a step later, as a SizeError.  Ranks of a LocalGroup live in one process, where
    ``dispatchers`` builds them all from one set of sizes; a stand-in without a communicator
    agrees with itself."""
    comm = getattr(coll, "comm", None)
    if comm is None or getattr(comm, "local_group", None) is not None or not hasattr(comm, "allgather"):
        return
    from purlinc.runtime.communicator import check_exchange
    from purlinc.runtime.errors import MismatchError

    everyone = check_exchange(comm, ("moe-dispatcher", sorted(sizes.items())), lambda error: MismatchError(
        f"Dispatcher: rank {comm.rank} was built, but a peer did not join the exchange of its sizes "
        f"({type(error).__name__})", notes=("build the Dispatcher on every rank",)))
    problem = disagreement(sizes, everyone)
    if problem:
        raise MismatchError(f"Dispatcher: the ranks disagree on {problem}", notes=(
            "build every rank's Dispatcher with the same num_experts, hidden, top_k, max_tokens and dtype",))


def disagreement(sizes: dict, everyone: list) -> str | None:
    """The first of ``sizes`` on which the ranks' entries (``("moe-dispatcher", items)``)
    differ, in words; None when they agree."""
    peers = []
    for rank, entry in enumerate(everyone):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and entry[0] == "moe-dispatcher"):
            return f"what they were doing: rank {rank} was in another exchange ({entry!r:.80})"
        peers.append(dict(entry[1]))
    for name in sizes:
        values = [p.get(name) for p in peers]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
            return f"{name}: {shown}"
    return None


class Dispatcher:
    """One rank's dispatch and combine; every buffer is allocated here, once.  Under torchrun
    every rank builds its own, with the same sizes (checked: a host-side exchange).

    ``topk_ids`` must hold expert ids in [0, num_experts).  Ids on the host (a CPU tensor) are
    checked; ids on the GPU are not (a check would synchronise the host with the device, and a
    captured step cannot): a slot whose id is out of range there is dropped (sent nowhere, its
    weight in no sum)."""

    def __init__(self, coll, *, rank: int, world_size: int, num_experts: int, hidden: int, top_k: int,
                 max_tokens: int, dtype: torch.dtype = torch.bfloat16, device=None):
        rank, world_size, num_experts, hidden, top_k, max_tokens = _check_shape(  # NumPy integers too
            rank, world_size, num_experts, hidden, top_k, max_tokens, dtype)
        _check_capacity(coll, hidden, top_k, max_tokens, dtype)
        _same_group(coll, rank, world_size)
        device = _device_of(coll, device)
        _agree(coll, {"world_size": world_size, "num_experts": num_experts, "hidden": hidden, "top_k": top_k,
                      "max_tokens": max_tokens, "dtype": str(dtype).removeprefix("torch.")})
        self.coll, self.rank, self.world_size = coll, rank, world_size
        self.num_experts, self.local_experts = num_experts, num_experts // world_size
        self.hidden, self.top_k, self.max_tokens, self.dtype = hidden, top_k, max_tokens, dtype
        self.width = row_elements(hidden, top_k, dtype)
        self.slots = max_tokens * min(world_size, top_k)  # (token, rank) rows a rank may send
        R, W, dev = world_size, self.width, device
        self.send = torch.zeros(self.slots + 1, W, dtype=dtype, device=dev)  # + 1: where unused pairs point
        self.recv = torch.zeros(R * max_tokens, W, dtype=dtype, device=dev)
        self.back = torch.zeros(self.slots + 1, hidden, dtype=dtype, device=dev)
        self.counts = torch.zeros(R, dtype=torch.int64, device=dev)
        self.recv_counts = torch.zeros(R, dtype=torch.int64, device=dev)
        self.back_counts = torch.zeros(R, dtype=torch.int64, device=dev)
        self.token_of = torch.zeros(self.slots + 1, dtype=torch.int64, device=dev)  # send row -> token
        # Constant index tensors of the routing, made once: each would be a kernel in every step
        # (a step of one token is a few dozen small kernels, so their count is its latency).
        self._pair_token = torch.arange(max_tokens, device=dev).repeat_interleave(R)  # (t, d) pair -> t
        self._send_rows = torch.arange(self.slots + 1, device=dev)
        self._recv_rows = torch.arange(R * max_tokens, device=dev)
        self._tokens = 0
        self._dispatched = False  # combine sends back what the last dispatch received: none yet

    def warm(self, expert=None) -> None:
        """Load this rank's kernel, then run the step's own tensor kernels once with no exchange
        (and ``expert``'s, through :func:`expert_weighted_sum`, when given).

        Why: CUDA loads a kernel at its first launch (lazy loading, the default since CUDA
        12.2), and that load waits for the kernels running on the device.  Where one host
        thread issues several ranks (a LocalGroup), a first launch queued behind rank r's
        running exchange would wait for a peer's exchange the thread has not issued yet, until
        the exchange times out.  Call it on every rank before the first step (``dispatchers``
        does); it leaves no routing behind."""
        self.coll.warm(_purlin_dtype(self.dtype))
        dev, T, k = self.send.device, self.max_tokens, self.top_k
        x = torch.zeros(T, self.hidden, dtype=self.dtype, device=dev)
        spread = (torch.arange(T * k, device=dev) % self.num_experts).view(T, k)  # distinct per token (k <= E)
        for ids_dtype, weights_dtype in ((torch.int64, torch.float32), (torch.int32, self.dtype)):
            ids, w = spread.to(ids_dtype), torch.ones(T, k, dtype=weights_dtype, device=dev)
            for tokens in (T, 1, 0):
                self._pack(x[:tokens], ids[:tokens], w[:tokens])
        got = self._received()
        partial = expert_weighted_sum(got, expert, self.local_experts) if expert else got.tokens.contiguous()
        for tokens in (T, 1, 0):
            self._sum_back(partial, tokens)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.counts.zero_()
        self._tokens = 0
        self._dispatched = False  # its routing replaced the last dispatch's: a combine now has none to follow

    # ---- routing
    def _route(self, topk_ids: torch.Tensor, T: int):
        """Send rows in order (rank, token): row of (t, d) at offset[d] + (tokens before t that go to d).
        Returns (pos [T, R]: each pair's row, ``slots`` for pairs not sent; ends [R]: each rank's rows end)."""
        R, dev = self.world_size, topk_ids.device
        ids = topk_ids.to(torch.int64)
        dest = torch.div(ids, self.local_experts, rounding_mode="floor")
        # An id outside [0, E) goes to column R, dropped: on the GPU nothing checks the ids (class
        # doc), and scatter_ out of bounds is a device-side assert there, which ends the process's
        # CUDA context while its peers wait in the exchange.
        dest = torch.where((ids >= 0) & (ids < self.num_experts), dest, R)
        mask = torch.zeros(T, R + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :R]
        counts = mask.sum(0)
        self.counts.copy_(counts)
        ends = torch.cumsum(counts, 0)
        pos = torch.cumsum(mask, 0) + (ends - counts - 1)  # rows before this rank's, then tokens before t
        return torch.where(mask, pos, self.slots), ends

    def _fill(self, x, topk_ids, topk_weights, pos, ends) -> None:
        T, R, H = x.shape[0], self.world_size, self.hidden
        if T == 0:  # nothing to send; every row belongs to no token
            self.token_of.fill_(0)
            return
        self.token_of.fill_(T).scatter_(0, pos.reshape(-1), self._pair_token[:T * R])
        # the unused-pair row belongs to no token; a fill kernel, not a host copy (capturable)
        self.token_of[self.slots:].fill_(T)
        tok = self.token_of.clamp(max=T - 1)  # rows of no token read token T - 1: sent nowhere
        row_rank = torch.searchsorted(ends, self._send_rows, right=True)  # rows are packed by rank
        self.send[:, :H].copy_(x[tok])
        ids = topk_ids[tok]
        mine = torch.div(ids, self.local_experts, rounding_mode="floor") == row_rank[:, None]
        local = torch.where(mine, ids % self.local_experts, -1)  # the expert's number on that rank
        weights = torch.where(mine, topk_weights[tok], 0)
        ids_view, weights_view = self._meta(self.send)
        ids_view.copy_(local)
        weights_view.copy_(weights)

    def _meta(self, rows: torch.Tensor):
        """The top-k ids (int32) and weights (float32) riding in each row of ``rows`` (send or
        receive buffer), as views of its bytes after the token's ``hidden`` elements."""
        k, N = self.top_k, rows.shape[0]
        raw = rows.view(torch.uint8)[:, self.hidden * rows.element_size():]  # [N, 8k] bytes
        if raw.stride(0) % 4 == 0 and raw.storage_offset() % 4 == 0:
            words = raw.view(torch.int32)
            return words[:, :k], words[:, k:].view(torch.float32)
        # rows whose metadata is not 4-byte aligned (an odd hidden of a 2-byte dtype): byte copies
        return _Bytes(raw[:, :4 * k], torch.int32, N, k), _Bytes(raw[:, 4 * k:], torch.float32, N, k)

    # ---- the two exchanges
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        self._tokens = self._pack(x, topk_ids, topk_weights)
        self.coll(self.send, self.counts, self.recv, self.recv_counts, row=self.width)
        self._dispatched = True
        return self._received()

    def _pack(self, x, topk_ids, topk_weights) -> int:
        """Route and fill the send rows (and ``counts``); returns the number of tokens."""
        T = self._check(x, topk_ids, topk_weights)
        pos, ends = self._route(topk_ids, T)
        self._fill(x, topk_ids, topk_weights, pos, ends)
        return T

    def _received(self) -> Dispatched:
        rows = self.recv_counts.sum()
        used = (self._recv_rows < rows)[:, None]
        ids_view, weights_view = self._meta(self.recv)
        ids = torch.where(used, _values(ids_view), -1)
        weights = torch.where(ids >= 0, _values(weights_view), 0)
        return Dispatched(self.recv[:, :self.hidden], ids, weights, self.recv_counts, rows)

    def combine(self, partial: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``partial[n]``: received row n's weighted sum over this rank's experts ([N, H], the
        dispatch's dtype).  Returns [T, H]: every token's sum of its partials, in token order."""
        N, H, T = self.recv.shape[0], self.hidden, self._tokens
        _tensors("combine", [("partial", partial)], self.recv.device)
        if tuple(partial.shape) != (N, H) or partial.dtype != self.dtype:
            raise ArgumentError(f"combine: partial is {tuple(partial.shape)} {partial.dtype}, expected ({N}, {H}) "
                                f"{self.dtype} (one row per received row)")
        if not partial.is_contiguous():  # (Dispatched.tokens is a view of wider rows: copy it, or write a new one)
            raise ArgumentError(f"combine: partial is not contiguous (strides {tuple(partial.stride())}), expected a "
                                f"contiguous ({N}, {H}) tensor", notes=("pass partial.contiguous()",))
        if out_dtype is not None:
            _float_dtype("combine", "out_dtype", out_dtype)
        if not self._dispatched:  # there is nothing to send back: an exchange now would return (0, H)
            raise ArgumentError("combine: no dispatch() has run on this Dispatcher; combine returns the partials "
                                "of the rows the last dispatch received", notes=("call dispatch() first",))
        self.coll(partial, self.recv_counts, self.back, self.back_counts, row=H)
        return self._sum_back(partial, T, out_dtype)

    def _sum_back(self, partial: torch.Tensor, T: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every token's sum of the partials that came back (``back``), in token order."""
        out = torch.zeros(T + 1, self.hidden, dtype=torch.float32, device=partial.device)
        out.index_add_(0, self.token_of, self.back.to(torch.float32))
        return out[:T].to(out_dtype or self.dtype)

    def _check(self, x, topk_ids, topk_weights) -> int:
        _tensors("dispatch", [("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)], self.send.device)
        T = x.shape[0] if x.dim() == 2 else -1
        if T < 0 or x.shape[1] != self.hidden or x.dtype != self.dtype or T > self.max_tokens:
            raise ArgumentError(f"dispatch: x is {tuple(x.shape)} {x.dtype}, expected (T, {self.hidden}) {self.dtype} "
                                f"with T <= max_tokens = {self.max_tokens}")
        for label, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tuple(t.shape) != (T, self.top_k) or t.device != x.device:
                raise ArgumentError(f"dispatch: {label} is {tuple(t.shape)} on {t.device}, expected ({T}, {self.top_k}) "
                                    f"on {x.device}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ArgumentError(f"dispatch: topk_ids has dtype {topk_ids.dtype}, expected int32 or int64")
        if not topk_weights.is_floating_point():  # cast into float32 rows: a complex one lost its imaginary part,
            # an integer one is most likely the ids passed twice or swapped
            raise ArgumentError(f"dispatch: topk_weights has dtype {topk_weights.dtype}, expected a real floating dtype")
        if topk_ids.device.type == "cpu":  # on the GPU this would synchronise: a precondition there (class doc)
            self._check_ids(topk_ids)
        return T

    def _check_ids(self, topk_ids) -> None:
        bad = ((topk_ids < 0) | (topk_ids >= self.num_experts)).nonzero()
        if len(bad):
            t, j = bad[0].tolist()
            raise ArgumentError(f"dispatch: topk_ids[{t}, {j}] = {int(topk_ids[t, j])}, expected an expert id in "
                                f"[0, {self.num_experts})")


class _Bytes:
    """A [N, k] int32 or float32 view that ``_meta`` could not make (misaligned bytes): ``copy_``
    writes a tensor's bytes into them, ``read`` returns a contiguous copy."""

    def __init__(self, raw: torch.Tensor, dtype: torch.dtype, n: int, k: int):
        self.raw, self.dtype, self.n, self.k = raw, dtype, n, k

    def copy_(self, values: torch.Tensor) -> None:
        self.raw.copy_(values.to(self.dtype).contiguous().view(torch.uint8).view(self.n, 4 * self.k))

    def read(self) -> torch.Tensor:
        return self.raw.contiguous().view(self.dtype).view(self.n, self.k)


def _values(view) -> torch.Tensor:
    """What a view of ``Dispatcher._meta`` holds, as a tensor."""
    return view.read() if isinstance(view, _Bytes) else view


def expert_weighted_sum(got: Dispatched, expert, local_experts: int) -> torch.Tensor:
    """``partial[n] = sum_j weights[n, j] * expert(ids[n, j], tokens[n])`` over the slots whose
    expert is here, in float32, rounded once to the tokens' dtype.  ``expert(e, rows)`` maps
    [N, H] rows to [N, H] (here every expert runs on every row, masked: a reference for tests
    and examples; a serving engine runs grouped GEMMs over the rows each expert holds)."""
    acc = torch.zeros(got.tokens.shape, dtype=torch.float32, device=got.tokens.device)
    tokens = got.tokens.contiguous()
    for e in range(local_experts):
        picked = got.expert_ids == e
        w = torch.where(picked, got.weights, torch.zeros_like(got.weights)).sum(1)
        # where, not a product by 0: an expert's inf or NaN on a row that did not pick it made the
        # row NaN (0 * inf)
        acc += torch.where(picked.any(1)[:, None], w[:, None] * expert(e, tokens).to(torch.float32), 0.0)
    return acc.to(tokens.dtype)


def _purlin_dtype(dtype: torch.dtype):
    from purlinc.runtime.interop import _torch_dtype_map

    return _torch_dtype_map()[dtype]


def dispatchers(group, *, num_experts: int, hidden: int, top_k: int, max_tokens: int,
                dtype: torch.dtype = torch.bfloat16, channels: int = 16, expert=None) -> list[Dispatcher]:
    """Every rank's Dispatcher for a LocalGroup (loopback or one process over several GPUs),
    their kernels loaded and warmed (``Dispatcher.warm``, with ``expert`` when given): call rank
    r's on its own stream (``torch.cuda.stream``).  ``channels``: thread blocks per rank (one
    block moves about 46 GB/s over NVLink; 16 is a start, not a measured optimum)."""
    import purlinc

    # Every size checked before the load, which takes staging on every rank and loads a kernel
    # (a Dispatcher's own check came after it, and left the load behind)
    _check_shape(0, len(group), num_experts, hidden, top_k, max_tokens, dtype)
    coll = purlinc.load(SOURCE, group, capacity=capacity_for(hidden, top_k, max_tokens, dtype),
                        dtype=_purlin_dtype(dtype).value, channels=channels)
    made = [Dispatcher(coll[r], rank=r, world_size=len(group), num_experts=num_experts, hidden=hidden, top_k=top_k,
                       max_tokens=max_tokens, dtype=dtype, device=f"cuda:{comm.device}")
            for r, comm in enumerate(group.comms)]
    for d in made:
        d.warm(expert)
    return made
