"""The torch-free rendezvous: TCP and file stores, the all-gather over them, env parsing and
bounded waits.  Real processes on loopback (spawned with subprocess), every one under a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from purlinc.runtime.rendezvous import (
    Exchange, FileStore, RendezvousError, RendezvousTimeout, TCPStore, dumps, env_info, loads,
)

REPO = Path(__file__).resolve().parent.parent

# One rank: rendezvous from the environment (as a launcher would set it), three all-gathers,
# a check that no torch was imported, and the result as JSON on stdout.
WORKER = textwrap.dedent("""
    import json, os, sys
    from purlinc.runtime import rendezvous as rv
    info = rv.env_info()
    kind = sys.argv[1]
    if kind == "tcp":
        store = rv.store_from_env(info, timeout=20)
    else:
        store = rv.FileStore(sys.argv[2], timeout=20)
    ex = rv.Exchange(store, info.rank, info.world_size, timeout=20)
    a = ex({"rank": info.rank, "handle": bytes([info.rank]) * 64, "local": info.local_rank})
    b = ex(("second", info.rank * 10))
    ex.barrier()
    print(json.dumps({"a": [[x["rank"], x["handle"].hex()[:4], x["local"]] for x in a], "b": b,
                      "torch": "torch" in sys.modules}))
    sys.stdout.flush()
    ex.barrier()   # rank 0 (the server) stays up until everyone has read
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, kind: str, extra: list[str], port: int, drop: set[int] = frozenset(), timeout=60):
    procs = []
    for rank in range(world):
        if rank in drop:
            continue
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, kind, *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_processes_gather_in_rank_order(kind, tmp_path):
    world = 3
    outs = launch(world, kind, [str(tmp_path / "store")] if kind == "file" else [], free_port())
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0, err[-2000:]
        got = json.loads(out)
        assert got["a"] == [[r, f"{r:02x}{r:02x}", r] for r in range(world)]
        assert got["b"] == [["second", r * 10] for r in range(world)]
        assert got["torch"] is False  # the rendezvous never imports torch
    if kind == "file":  # rounds older than the last two were cleared (4 rounds were made)
        left = sorted(p.name for p in (tmp_path / "store").iterdir() if not p.name.startswith("."))
        assert left == sorted([f"purlin%2Fg1%2F{n}%2F{r}" for n in (2, 3) for r in range(world)]
                              + [f"purlin%2Fgeneration%2F{r}" for r in range(world)])


def test_missing_rank_times_out_with_its_number(tmp_path):
    # Rank 2 of 3 never starts: ranks 0 and 1 must fail within their bound, naming rank 2.
    start = time.monotonic()
    worker = WORKER.replace("timeout=20", "timeout=2")
    procs = []
    port = free_port()
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, "-c", worker, "tcp"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode != 0
        assert "RendezvousTimeout" in err and "for rank 2 of 3" in err and "never arrived" in err
    assert time.monotonic() - start < 30


def test_unreachable_store_is_a_clear_timeout():
    port = free_port()  # nobody serves it
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout, match=rf"could not reach the rendezvous store at 127.0.0.1:{port} within 0.5 s"):
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - start < 5


def test_tcp_store_in_process():
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=5)
    client = TCPStore("127.0.0.1", server.port, timeout=5)
    try:
        client.set("k", b"\x00\x01binary")
        assert server.get("k") == b"\x00\x01binary"
        assert server.add("n", 2) == 2 and client.add("n", 3) == 5
        with pytest.raises(RendezvousTimeout, match="key 'absent' did not appear .* within 0.2 s"):
            client.get("absent", timeout=0.2)
        client.delete(["k"])
        with pytest.raises(RendezvousTimeout):
            server.get("k", timeout=0.1)
    finally:
        client.close()
        server.close()


def test_file_store_in_process(tmp_path):
    store = FileStore(tmp_path, timeout=1)
    store.set("a/b", b"v")
    assert FileStore(tmp_path).get("a/b") == b"v"
    assert store.add("c", 4) == 4 and store.add("c", -1) == 3
    with pytest.raises(RendezvousTimeout, match="key 'zz' did not appear"):
        store.get("zz", timeout=0.05)


def test_exchange_single_rank(tmp_path):
    ex = Exchange(FileStore(tmp_path), 0, 1)
    assert ex({"x": 1}) == [{"x": 1}] and ex("y") == ["y"]
    with pytest.raises(RendezvousError, match="rank 3 is outside the world of 2"):
        Exchange(FileStore(tmp_path), 3, 2)


def test_plain_data_only():
    assert loads(dumps({"a": (1, b"x", None, [2.5])})) == {"a": (1, b"x", None, [2.5])}
    with pytest.raises(RendezvousError, match="refused pathlib.PosixPath"):
        loads(dumps(Path("/tmp")))


@pytest.mark.parametrize("env, words", [
    ({}, "RANK is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'x'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK must be in \[0, 2\)"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT must be a TCP port"),
    # the store refused it as "host must be a host name or address, got ''", naming no variable
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": ""}, "environment variable MASTER_ADDR is empty"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "  "}, "environment variable MASTER_ADDR is empty"),
    # a port in the address: the lookup of '127.0.0.1:5' failed only after the whole timeout
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1:5"},
     r"MASTER_ADDR='127.0.0.1:5' names a port: .* \(MASTER_ADDR=127.0.0.1 MASTER_PORT=5\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node0:29500"}, "MASTER_ADDR='node0:29500' names a port"),
])
def test_env_errors(env, words):
    with pytest.raises(RendezvousError, match=words):
        env_info(env)


def test_an_ipv6_master_addr_is_no_host_with_a_port():
    for addr in ("::1", "fe80::1", "2001:db8::8:800"):
        assert env_info({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": addr}).master_addr == addr


def test_env_defaults():
    info = env_info({"RANK": "1", "WORLD_SIZE": "2"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port) == (1, 2, 1, "127.0.0.1", 29500)
    assert env_info({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": " node0\n"}).master_addr == "node0"  # as $(cat file)


def test_communicator_from_env_reads_the_environment_first(monkeypatch):
    # Before any GPU work: a missing variable is a RendezvousError, not a driver failure.
    from purlinc.runtime.communicator import Communicator

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RendezvousError, match="environment variable RANK is not set"):
        Communicator.from_env()


def test_a_failed_exchange_stops_the_communicator():
    # from_torch's exchange: a store that times out becomes PurlinTimeoutError, stops the
    # communicator, and every later exchange is refused at once (the peers' state is unknown)
    from purlinc.runtime.communicator import Communicator, _reporting
    from purlinc.runtime.errors import PurlinTimeoutError

    calls = []

    def exchange(obj):
        calls.append(obj)
        raise RendezvousTimeout("rendezvous round 3: rank 0 waited 1 s for rank 1 of 2, which never arrived")
    holder: list = []
    call = _reporting(exchange, 0, 1.0, holder)
    holder.append(Communicator(0, 2, 0, None, call))
    with pytest.raises(PurlinTimeoutError, match=r"rank 0: the host-side exchange with the other ranks failed "
                                                 r"\(bound 1 s\): rendezvous round 3"):
        call("first")
    assert holder[0].failed is not None
    with pytest.raises(PurlinTimeoutError, match="communicator stopped after an earlier timeout"):
        call("second")
    assert calls == ["first"]


def test_an_exchange_made_again_on_a_store_never_reads_the_last_ones_rounds(tmp_path):
    """The recovery after a timeout is a new communicator, often on the same store: its rounds
    must not find the values its predecessor left there (the last two rounds stay), which a
    late peer would otherwise seem to have written."""
    store = FileStore(tmp_path, timeout=5)
    first = [Exchange(store, r, 2, timeout=5) for r in range(2)]
    for n in range(3):
        threads = [threading.Thread(target=first[r], args=(("old", n, r),)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    again = Exchange(store, 0, 2, timeout=0.5)  # rank 1 of the new pair never comes
    assert again.generation == 2
    with pytest.raises(RendezvousTimeout, match="rendezvous round 0: rank 0 waited 0.5 s for rank 1"):
        again(("new", 0, 0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1, "x", True])
def test_timeouts_are_finite_positive_seconds(tmp_path, bad):
    """A NaN bound never passes its deadline (FileStore.get waited forever on one)."""
    with pytest.raises(RendezvousError, match="timeout must be a finite number of seconds above 0"):
        FileStore(tmp_path, timeout=bad)
    with pytest.raises(RendezvousError, match="timeout must be a finite number of seconds above 0"):
        FileStore(tmp_path).get("k", bad)
    with pytest.raises(RendezvousError, match="timeout must be a finite number of seconds above 0"):
        TCPStore("127.0.0.1", 0, is_server=True, timeout=bad)


@pytest.mark.parametrize("port", [-1, 70000, "29500", 1.5, None, True])
def test_ports_are_checked_before_anything_starts(port):
    with pytest.raises(RendezvousError, match=r"port must be an integer in 0 \(any free port\) or 1..65535"):
        TCPStore("127.0.0.1", port, is_server=True, timeout=1)
    assert not [t for t in threading.enumerate() if t.name == "purlin-store"]


def test_a_communicator_that_fails_after_its_store_leaves_the_port_free(monkeypatch):
    """from_env starts rank 0's server; when a later step fails (here: no GPU driver, or a
    stand-in failure) the server is closed, so a retry can serve on the same port."""
    from purlinc.runtime.communicator import Communicator

    port = free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))

    def fail(*args, **kwargs):
        raise RendezvousError("a later step failed")

    monkeypatch.setattr(Communicator, "from_store", classmethod(lambda cls, *a, **k: fail()))
    with pytest.raises(RendezvousError, match="a later step failed"):
        Communicator.from_env(timeout=5)
    again = TCPStore("127.0.0.1", port, is_server=True, timeout=5)  # the port is free again
    again.close()


@pytest.mark.parametrize("key", [".", "..", "../escape", "a" * 300, "%2E", "x/../../y"])
def test_file_store_keys_stay_inside_its_directory(tmp_path, key):
    store = FileStore(tmp_path / "store", timeout=1)
    store.set(key, b"v")
    assert store.get(key) == b"v"
    inside = list((tmp_path / "store").iterdir())
    assert all(p.parent == tmp_path / "store" for p in inside) and not (tmp_path / "escape").exists()
    assert not [p for p in inside if p.name.endswith(".tmp")]


@pytest.mark.parametrize("call, message", [
    (lambda s: s.set("k", 3), "a store value is bytes, got int"),
    (lambda s: s.set("k", "text"), "a store value is bytes, got str"),
    (lambda s: s.set(5, b"v"), "a store key is a non-empty string without NUL, got 5"),
    (lambda s: s.set("", b"v"), "a store key is a non-empty string without NUL, got ''"),
    (lambda s: s.delete("abc"), "delete takes a list of keys, got the string 'abc'"),
])
def test_store_arguments_are_checked(tmp_path, call, message):
    for store in (FileStore(tmp_path, timeout=1), TCPStore("127.0.0.1", 0, is_server=True, timeout=5)):
        try:
            with pytest.raises(RendezvousError) as info:
                call(store)
            assert info.value.message == message
        finally:
            store.close(wait=False)


def test_add_to_a_key_that_holds_no_number_is_refused_and_the_connection_lives(tmp_path):
    """The server's handler died on it (a traceback on rank 0, and every later request of that
    client said the store 'went away')."""
    tcp = TCPStore("127.0.0.1", 0, is_server=True, timeout=5)
    try:
        tcp.set("c", b"xyz")
        with pytest.raises(RendezvousError, match="refused a request for 'c': ValueError"):
            tcp.add("c", 1)
        tcp.set("d", b"1")
        assert tcp.add("d", 2) == 3  # the same connection still serves
    finally:
        tcp.close(wait=False)
    files = FileStore(tmp_path, timeout=1)
    files.set("c", b"xyz")
    with pytest.raises(RendezvousError, match="add: key 'c' holds b'xyz', not a number"):
        files.add("c", 1)


@pytest.mark.parametrize("store, rank, world, message", [
    (None, 0, 1, "store None lacks set, get, add, delete"),
    ("file", True, 2, "rank must be an integer, got True"),
    ("file", 0, 2.5, "world_size must be an integer, got 2.5"),
    ("file", "0", 2, "rank must be an integer, got '0'"),
])
def test_an_exchange_checks_its_arguments_before_the_store(tmp_path, store, rank, world, message):
    """From Communicator.from_store these reached the GPU driver (or a TypeError) before."""
    with pytest.raises(RendezvousError) as info:
        Exchange(FileStore(tmp_path) if store == "file" else store, rank, world)
    assert info.value.message.startswith(message)


def _stub_driver(monkeypatch):
    """Enough of the driver for a heap bootstrap with no GPU: allocations are numbers."""
    from purlinc.runtime import driver

    for name, stub in (("device_count", lambda: 2), ("set_current", lambda d: None),
                       ("can_access_peer", lambda a, b: True), ("mem_alloc", lambda n: 0x10000000),
                       ("mem_free", lambda p: None), ("memset_d8", lambda *a: None),
                       ("synchronize", lambda d: None), ("ipc_handle", lambda p: (b"h" * 64, 0)),
                       ("ipc_open", lambda h, o: 0x70000000)):
        monkeypatch.setattr(driver, name, stub)


def test_a_store_communicator_stops_after_a_failed_exchange(tmp_path, monkeypatch):
    """from_store's exchanges were bare: a peer that left gave RendezvousTimeout (not a
    PurlinTimeoutError), the communicator stayed usable, and its next exchange went on to the
    next round, out of step with every peer.  Now as from_torch: stopped, later calls refused."""
    from purlinc.runtime.communicator import Communicator
    from purlinc.runtime.errors import PurlinTimeoutError

    _stub_driver(monkeypatch)
    store = FileStore(tmp_path, timeout=5)
    peer = Exchange(store, 1, 2, timeout=5)  # rank 1, played here: it joins the bootstrap, then leaves

    def rank_one():
        peer({"host": socket.gethostname(), "pid": os.getpid() + 1, "device": 1})
        peer({"segment": 0, "size": 1 << 20, "handle": b"p" * 64, "offset": 0})
        peer(("heap-open", 0))

    thread = threading.Thread(target=rank_one)
    thread.start()
    comm = Communicator.from_store(store, 0, 2, heap_bytes=1 << 20, timeout=0.5)
    thread.join()
    with pytest.raises(PurlinTimeoutError, match=r"rank 0: the host-side exchange with the other ranks failed "
                                                 r"\(bound 0.5 s\): rendezvous round 3: rank 0 waited 0.5 s for rank 1"):
        comm.allgather("after rank 1 left")
    assert comm.failed is not None
    started = time.monotonic()
    with pytest.raises(PurlinTimeoutError, match="communicator stopped after an earlier timeout"):
        comm.allgather("again")
    assert time.monotonic() - started < 0.4  # refused at once, not another wait


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "0"}, "device: expected a CUDA device ordinal (an int), got '0'"),
    ({"device": 1.5}, "device: expected a CUDA device ordinal (an int), got 1.5"),
    ({"device": True}, "device: expected a CUDA device ordinal (an int), got True"),
    ({"heap_bytes": -5}, "heap_bytes: expected an int of at least 1048576 (1 MiB), got -5"),
    ({"heap_bytes": "1024"}, "heap_bytes: expected an int of at least 1048576 (1 MiB), got '1024'"),
    ({"heap_bytes": 1.5e6}, "heap_bytes: expected an int of at least 1048576 (1 MiB), got 1500000.0"),
    ({"heap_bytes": True}, "heap_bytes: expected an int of at least 1048576 (1 MiB), got True"),
    ({"heap_bytes": 4096}, "heap_bytes: expected an int of at least 1048576 (1 MiB), got 4096"),
])
def test_communicator_arguments_are_checked_before_the_driver(tmp_path, monkeypatch, kwargs, message):
    """A string device failed in a comparison (TypeError), True was read as cuda:1, and any
    heap_bytes went to the driver's allocation as given (the environment's PURLIN_HEAP_MB was
    range-checked, the keyword was not)."""
    from purlinc.runtime import driver
    from purlinc.runtime.communicator import Communicator, LocalGroup
    from purlinc.runtime.errors import ArgumentError

    touched = []
    monkeypatch.setattr(driver, "device_count", lambda: touched.append("device_count") or 2)
    monkeypatch.setattr(driver, "mem_alloc", lambda n: touched.append("mem_alloc") or 0x1000)
    with pytest.raises(ArgumentError) as info:
        Communicator.from_store(FileStore(tmp_path, timeout=1), 0, 1, **kwargs)
    assert info.value.message == message
    group_kwargs = {"devices": [kwargs["device"]]} if "device" in kwargs else {"devices": [0], **kwargs}
    with pytest.raises(ArgumentError) as info:
        LocalGroup(**group_kwargs)
    assert info.value.message == message.replace("device:", "LocalGroup device 0:")
    assert "mem_alloc" not in touched


def _gather_in_threads(exchanges, objs):
    """Run one round of every exchange in threads; each rank's result or exception."""
    results: dict[int, object] = {}

    def run(i):
        try:
            results[i] = exchanges[i](objs[i])
        except Exception as error:  # noqa: BLE001 -- the test looks at it
            results[i] = error
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(exchanges))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [results[i] for i in range(len(exchanges))]


def test_a_peer_of_another_world_size_is_refused_not_gathered(tmp_path):
    """Rank 0 started with WORLD_SIZE=2, ranks 1 and 2 with 3: rank 0 gathered [0, 1] and the
    others [0, 1, 2], every process content.  Now each record says its world."""
    from purlinc.runtime.errors import MismatchError
    from purlinc.runtime.rendezvous import RendezvousMismatch

    store = FileStore(tmp_path, timeout=2)
    exchanges = [Exchange(store, 0, 2, timeout=2), Exchange(store, 1, 3, timeout=2), Exchange(store, 2, 3, timeout=2)]
    started = time.monotonic()
    got = _gather_in_threads(exchanges, ["a", "b", "c"])
    assert time.monotonic() - started < 1.5  # refused at the first record read, not after a timeout
    assert all(isinstance(e, RendezvousMismatch) and isinstance(e, MismatchError) for e in got)
    assert got[0].message == ("rendezvous round 0: rank 1 belongs to a world of 3 ranks, but rank 0 to one of 2: "
                              "expected WORLD_SIZE=2 on every rank")
    assert got[1].message.startswith("rendezvous round 0: rank 0 belongs to a world of 2 ranks, but rank 1 to one of 3")


def test_a_foreign_value_under_an_exchange_key_is_named(tmp_path):
    from purlinc.runtime.rendezvous import RendezvousMismatch

    store = FileStore(tmp_path, timeout=1)
    ex = Exchange(store, 0, 2, timeout=1)
    store.set(f"{ex.base}/0/1", b"not a pickle")
    with pytest.raises(RendezvousMismatch, match=r"rendezvous round 0: the store's key purlin/g1/0/1 \(rank 1's\) "
                                                 r"holds b'not a pickle', not a Purlin rendezvous record"):
        ex("mine")


def test_a_second_process_as_the_same_rank_is_named_on_timeout(tmp_path):
    """Two processes started as rank 1: the second counted generation 2 and waited for rank 0
    there, then said rank 0 'never arrived' though rank 0 had gathered with the first."""
    store = FileStore(tmp_path, timeout=1)
    first = [Exchange(store, 0, 2, timeout=1), Exchange(store, 1, 2, timeout=1)]
    duplicate = Exchange(store, 1, 2, timeout=0.3)
    assert _gather_in_threads(first, ["a", "b"]) == [["a", "b"], ["a", "b"]]
    with pytest.raises(RendezvousTimeout) as info:
        duplicate("c")
    assert info.value.message.startswith(
        "rendezvous round 0: rank 1 waited 0.3 s for rank 0 of 2, which joined another generation of this store: "
        "rank 0 made 1 exchange(s) on it, rank 1 2 (two processes started as one rank, a store an earlier run left")


@pytest.fixture
def listener():
    """A TCP listener that is not a rendezvous store: ``reply`` is what it answers to a request
    (None: nothing, ever)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    state = {"reply": None, "conns": []}

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            state["conns"].append(conn)
            try:
                conn.recv(4096)
                if state["reply"] is not None:
                    conn.sendall(state["reply"])
            except OSError:
                pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], state
    server.close()
    for conn in state["conns"]:
        conn.close()


@pytest.mark.parametrize("reply, error, words", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", RendezvousError,
     r"did not answer a request for 'k' as a Purlin rendezvous store does \(its reply began b'HTTP/1.1 '\)"),
    (b"K" + (1 << 40).to_bytes(8, "big"), RendezvousError, "as a Purlin rendezvous store does"),
    (None, RendezvousTimeout, r"did not answer a request for 'k' within 0.5 s"),
    (b"K\x00\x00", RendezvousTimeout, r"did not answer a request for 'k' within 0.5 s"),
])
def test_a_port_held_by_another_service_is_named_within_the_bound(listener, reply, error, words):
    """An HTTP server's answer was read as a length of 6 * 10^18 bytes (MemoryError, no message);
    a listener that never answers held the client 30 s past its timeout, then said the store
    'went away'."""
    port, state = listener
    state["reply"] = reply
    store = TCPStore("127.0.0.1", port, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(error, match=words):
        store.set("k", b"v")
    assert time.monotonic() - started < 3
    with pytest.raises(RendezvousError, match="was dropped after an earlier failure"):
        store.add("k", 1)  # the half-read connection is not reused
    store.close()


def _raw_request(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(payload)
        return sock.recv(300)


def _frame(op: bytes, key: bytes, value: bytes) -> bytes:
    import struct

    return op + struct.pack("!I", len(key)) + key + struct.pack("!Q", len(value)) + value


@pytest.mark.parametrize("payload, words", [
    (b"S" + (0xFFFFFFFF).to_bytes(4, "big") + b"abc", b"key of 4,294,967,295 bytes is past the store's limit"),
    (b"S\x00\x00\x00\x01k" + (1 << 62).to_bytes(8, "big"), b"value of 4,611,686,018,427,387,904 bytes is past"),
    (_frame(b"S", b"\xff\xfe", b"v"), b"UnicodeDecodeError"),
    (_frame(b"G", b"k", b"nan"), b"a GET waits 0 to 1e+06 s, not b'nan'"),
    (_frame(b"G", b"k", b"1e300"), b"a GET waits 0 to 1e+06 s, not b'1e300'"),
])
def test_the_server_answers_garbage_without_a_traceback_or_a_spin(payload, words, capfd):
    """Rank 0's server allocated a claimed 2^62-byte value (MemoryError traceback), printed a
    UnicodeDecodeError traceback for a non-UTF-8 key, and spun forever on a GET of NaN seconds
    (which also kept rank 0's exit waiting for that client)."""
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=2)
    try:
        started = time.monotonic()
        reply = _raw_request(server.port, payload)
        assert reply[:1] == b"E" and words in reply
        assert time.monotonic() - started < 2
        server.set("still", b"serving")
        assert server.get("still") == b"serving"
    finally:
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 1.5  # no handler left holding the exit
    assert "Traceback" not in capfd.readouterr().err


def test_timeouts_and_values_have_an_upper_bound(tmp_path, monkeypatch):
    """A timeout of 1e300 s passed the check and reached the server's clock (OverflowError)."""
    from purlinc.runtime import rendezvous

    with pytest.raises(RendezvousError, match=r"timeout must be a finite number of seconds above 0, at most 1e\+06"):
        TCPStore("127.0.0.1", 0, is_server=True, timeout=1e300)
    assert FileStore(tmp_path, timeout=1e6).timeout == 1e6
    monkeypatch.setattr(rendezvous, "MAX_VALUE_BYTES", 1000)
    for store in (FileStore(tmp_path), TCPStore("127.0.0.1", 0, is_server=True, timeout=2)):
        with pytest.raises(RendezvousError, match="a store value is at most 1,000 bytes, got 1,001"):
            store.set("k", bytes(1001))
        store.close(wait=False)


def test_a_check_exchange_a_peer_never_joins_is_its_mismatch_and_stops_the_communicator(tmp_path):
    """The zero-copy / graph-buffer agreement checks: the check exchange's timeout (a Purlin
    error) passed through bare instead of the check's own message, and left the communicator
    running with its check rounds ahead of its peers' (their next check read this rank's
    stale record)."""
    from purlinc.runtime.communicator import Communicator, check_exchange
    from purlinc.runtime.errors import MismatchError, PurlinTimeoutError

    comm = Communicator(0, 2, 0, None, lambda obj: [obj, obj])
    comm._check_exchange = Exchange(FileStore(tmp_path, timeout=0.2), 0, 2, timeout=0.2)
    with pytest.raises(MismatchError, match="zc: a peer did not join the check: RendezvousTimeout"):
        check_exchange(comm, ("zero-copy", 1), lambda error: MismatchError(
            f"zc: a peer did not join the check: {type(error).__name__}"))
    assert comm.failed is not None
    with pytest.raises(PurlinTimeoutError, match="check exchange: rank 0's communicator stopped after an earlier "
                                                 "timeout .*a peer did not join the check"):
        check_exchange(comm, ("zero-copy", 2), lambda error: MismatchError("unused"))


def test_a_store_that_fails_at_once_is_not_reported_as_a_peer_that_never_arrived(tmp_path):
    """torch's store, when rank 0 (its server) exits, fails a wait at once and TorchStore calls
    that a timeout: Exchange said rank 0 'never arrived' after 'waiting 2 s' (0.05 s in truth)."""
    class Gone(FileStore):
        def get(self, key, timeout=None):
            raise RendezvousTimeout(f"key {key!r} did not appear within {timeout:g} s (Connection reset by peer)")

    ex = Exchange(Gone(tmp_path, timeout=2), 1, 2, timeout=2)
    started = time.monotonic()
    with pytest.raises(RendezvousTimeout) as info:
        ex("x")
    assert time.monotonic() - started < 1
    assert info.value.message.startswith("rendezvous round 0: rank 1's wait for rank 0 of 2 ended after ")
    assert "of its 2 s bound, when the store failed: key 'purlin/g1/0/0' did not appear" in info.value.message


def test_ranks_in_different_exchanges_are_a_mismatch_that_stops_the_communicator():
    """Rank 0 allocating a heap block while rank 1 makes the first call of a new shape: each read
    the other's record as its own (symmetric.alloc formatted a 'call' record's missing third
    field: IndexError; a 'zeroed' barrier passed with a peer doing something else)."""
    from purlinc.runtime import symmetric
    from purlinc.runtime.communicator import Communicator, check_exchange
    from purlinc.runtime.errors import MismatchError, PurlinTimeoutError

    class Heap:
        freed = []

        def alloc_user(self, nbytes, what):
            return 4096

        def ptr(self, rank, offset):
            return 1 << 40 | offset

        def free_user(self, offset):
            self.freed.append(offset)

    peer = ("call", ("allreduce", "float32", "sum", 1024))
    comm = Communicator(0, 2, 0, Heap(), lambda obj: [obj, peer])
    with pytest.raises(MismatchError) as info:
        symmetric.alloc(comm, 64)
    assert info.value.message == ("rank 0: the ranks made different host-side exchanges at the same point "
                                  "(rank 0: heap-block, rank 1: call)")
    assert Heap.freed == [4096] and comm.failed is not None
    with pytest.raises(PurlinTimeoutError, match="stopped after an earlier timeout"):
        comm.allgather(("zeroed", "x"))
    same = Communicator(0, 2, 0, None, lambda obj: [obj, {"host": "b"}])  # a record of no kind against one of a kind
    with pytest.raises(MismatchError, match=r"\(rank 0: zeroed, rank 1: another object\)"):
        same.allgather(("zeroed", "x"))
    plain = Communicator(0, 2, 0, None, lambda obj: [obj, {"host": "b"}])  # bootstrap's records name no kind
    assert plain.allgather({"host": "a"}) == [{"host": "a"}, {"host": "b"}]
    checked = Communicator(0, 2, 0, None, lambda obj: [obj, obj])
    checked._check_exchange = lambda obj: [obj, ("graph-buffers", "x")]
    with pytest.raises(MismatchError, match=r"\(rank 0: zero-copy, rank 1: graph-buffers\)"):
        check_exchange(checked, ("zero-copy", "x", 1), lambda error: MismatchError("unused"))
    assert checked.failed is not None


@pytest.mark.parametrize("obj, where, kind", [
    ({"count": np.int64(3)}, "obj['count']", "numpy.int64"),
    (lambda: 0, "obj", "function"),
    (("load", [1, {2.5: {b"k", 1j}}]), "a member of obj[1][1][2.5]", "complex"),
])
def test_an_object_that_is_not_plain_data_is_refused_before_it_is_sent(tmp_path, obj, where, kind):
    """The sender pickled it, then its own read-back called the record "not a Purlin rendezvous
    record" of "another program" (a NumPy integer), or pickle failed bare (a lambda)."""
    from purlinc.runtime.communicator import Communicator, _reporting
    from purlinc.runtime.errors import ArgumentError

    store = FileStore(tmp_path, timeout=1)
    holder: list = []
    holder.append(Communicator(0, 1, 0, None, _reporting(Exchange(store, 0, 1), 0, 1.0, holder)))
    with pytest.raises(ArgumentError) as info:
        holder[0].allgather(obj)
    assert not isinstance(info.value, RendezvousError)  # which would stop the communicator
    assert info.value.message.startswith(f"allgather: {where} is a {kind} (")
    assert info.value.message.endswith("which the ranks cannot exchange: expected plain data only (None, bool, "
                                       "int, float, str, bytes, bytearray, and tuples, lists, dicts, sets and "
                                       "frozensets of them)")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "purlin%2Fgeneration%2F0"]  # nothing written
    assert holder[0].failed is None and holder[0].allgather({"count": 3}) == [{"count": 3}]  # still round 0's turn
    assert (tmp_path / "purlin%2Fg1%2F0%2F0").exists()


@pytest.mark.parametrize("directory", [None, "", 5, b"/tmp"])
def test_a_file_store_directory_must_be_a_path(directory):
    from purlinc.runtime.errors import ArgumentError

    with pytest.raises(ArgumentError) as info:  # a bare TypeError from Path(None) before
        FileStore(directory)
    assert isinstance(info.value, RendezvousError)
    assert info.value.message == ("FileStore: directory must be a path (a non-empty str or os.PathLike) every rank "
                                  f"can see, got {directory!r}")


def test_a_key_whose_file_is_a_directory_is_named_with_its_path(tmp_path):
    """get, add and delete raised a bare IsADirectoryError, which named neither the key nor the store."""
    store = FileStore(tmp_path, timeout=1)
    (tmp_path / "k").mkdir()
    for op, call in (("get", lambda: store.get("k")), ("add", lambda: store.add("k", 1)),
                     ("set", lambda: store.set("k", b"v")), ("delete", lambda: store.delete(["k"]))):
        with pytest.raises(RendezvousError) as info:
            call()
        assert info.value.message.startswith(f"{op}: key 'k' of the file store {tmp_path} cannot be used: its file "
                                             f"{tmp_path / 'k'} cannot be read or written (")
        assert "is something else in its place (a directory" in info.value.notes[0]


def test_a_key_that_is_not_utf8_is_refused_by_the_key_check(tmp_path):
    """A lone surrogate passed the check, then failed as a UnicodeEncodeError in the store."""
    for store in (FileStore(tmp_path, timeout=1), TCPStore("127.0.0.1", 0, is_server=True, timeout=5)):
        try:
            for call in (lambda: store.set("a\udcff", b"x"), lambda: store.get("a\udcff"),
                         lambda: store.add("a\udcff", 1)):
                with pytest.raises(RendezvousError) as info:
                    call()
                assert info.value.message == ("a store key is UTF-8 text, got 'a\\udcff' with the lone surrogate "
                                              "'\\udcff' at index 1")
        finally:
            store.close(wait=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("delta, shown", [("5", "'5' (str)"), (1.5, "1.5 (float)"), (True, "True (bool)"),
                                          (None, "None (NoneType)")])
def test_add_takes_an_integer_delta(tmp_path, delta, shown):
    """int() read "5" as 5 and cut 1.5 to 1."""
    from purlinc.runtime.errors import ArgumentError

    for store in (FileStore(tmp_path, timeout=1), TCPStore("127.0.0.1", 0, is_server=True, timeout=5)):
        try:
            with pytest.raises(ArgumentError) as info:
                store.add("c", delta)
            assert info.value.message == f"add: delta must be an integer, got {shown}"
            assert store.add("c", np.int64(2)) == 2  # nothing was added by the refused call
        finally:
            store.close(wait=False)


@pytest.mark.parametrize("name, raw", [("RANK", "1_0"), ("WORLD_SIZE", "1" + "0" * 23), ("RANK", "+1"),
                                       ("LOCAL_RANK", "-1"), ("WORLD_SIZE", "\u0663"), ("MASTER_PORT", "9" * 5000),
                                       ("WORLD_SIZE", str((1 << 20) + 1))])
def test_env_integers_are_digits_up_to_a_bound(name, raw):
    """int() read RANK=1_0 as 10 and took WORLD_SIZE=10**23 as given."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500", name: raw}
    with pytest.raises(RendezvousError) as info:
        env_info(env)
    assert info.value.message == (f"environment variable {name} must be an integer, got {raw!r}: expected decimal "
                                  "digits only, a number from 0 to 1,048,576")
    assert env_info({**env, name: " 1 " if name != "WORLD_SIZE" else str(1 << 20)})  # spaces and the bound itself pass


def test_a_named_pipe_in_a_keys_place_is_refused_not_waited_on(tmp_path):
    """get() opened a named pipe at the key's path and blocked there past its own timeout."""
    store = FileStore(tmp_path, timeout=1)
    os.mkfifo(store._path("k"))
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"key 'k' of the file store .* cannot be read or written \(not a regular file\)"):
        store.get("k")
    assert time.monotonic() - started < 1


def test_a_directory_in_the_lock_files_place_is_a_store_error(tmp_path):
    """add() raised a bare IsADirectoryError, where get and set name the store."""
    store = FileStore(tmp_path, timeout=1)
    (tmp_path / ".lock").mkdir()
    with pytest.raises(RendezvousError, match=r"add: key 'n' of the file store .* its file .*\.lock cannot be read"):
        store.add("n", 1)


def test_a_file_store_on_a_file_says_so(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(RendezvousError) as info:
        FileStore(tmp_path / "afile")
    assert info.value.message == f"cannot use {tmp_path / 'afile'} as a file store: it is a file, not a directory"


def test_many_ranks_joining_at_once_meet_without_waiting_on_retransmits():
    """64 ranks connecting at once overflowed socketserver's backlog of 5: the kernel dropped
    the connections past it, and their first requests waited on TCP retransmits (15 s for one
    exchange; 128 ranks ran past a 30 s timeout)."""
    world = 64
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=30)
    start, gathered, errors = threading.Barrier(world), {}, []

    def rank(r):
        try:
            start.wait()
            store = server if r == 0 else TCPStore("127.0.0.1", server.port, timeout=30)
            exchange = Exchange(store, r, world, timeout=30)
            gathered[r] = exchange(r)
            exchange.barrier()
            if r:
                store.close()
        except Exception as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    began = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    server.close()
    assert not errors
    assert gathered == {r: list(range(world)) for r in range(world)}
    assert time.monotonic() - began < 6


def _store_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "purlin-store" or "process_request" in t.name]


def test_a_closed_server_hangs_up_on_its_clients_instead_of_serving_a_dead_world():
    """After rank 0 closed its store (a failed set-up: close(wait=False); or its wait for the
    clients ran out), the handlers of connected peers went on serving the old table: a peer's
    GET waited its whole timeout and then said rank 0 'never arrived', and its set() succeeded."""
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    peer = TCPStore("127.0.0.1", server.port, timeout=10)
    peer.set("k", b"v")
    outcome = []

    def waiting_get():
        started = time.monotonic()
        try:
            peer.get("never", 10)
        except RendezvousError as error:
            outcome.append((time.monotonic() - started, error))

    waiter = threading.Thread(target=waiting_get)
    waiter.start()
    time.sleep(0.2)
    server.close(wait=False)
    waiter.join(15)
    waited, error = outcome[0]
    assert waited < 3 and not isinstance(error, RendezvousTimeout)
    assert f"the rendezvous store at 127.0.0.1:{server.port} went away" in error.message
    assert "rank 0 serves the store: did it exit or crash?" in str(error)
    assert _store_threads() == []
    peer.close()


def test_a_new_world_on_the_port_never_reaches_the_store_of_the_last_one():
    """While the last world's rank 0 waited (bounded) for a peer that had not hung up, its
    server still accepted: a rank of the next world on that port joined the dead world's table
    (its generation counters), not the new store."""
    old = TCPStore("127.0.0.1", 0, is_server=True, timeout=3)
    lingering = TCPStore("127.0.0.1", old.port, timeout=3)  # a peer of the old world that never hangs up
    Exchange(lingering, 1, 2)  # the old world counted an exchange of rank 1
    closing = threading.Thread(target=old.close)
    closing.start()
    time.sleep(0.8)  # old.close() is waiting for `lingering`
    assert closing.is_alive()
    new = TCPStore("127.0.0.1", old.port, is_server=True, timeout=3)
    newcomer = TCPStore("127.0.0.1", old.port, timeout=3)
    assert Exchange(newcomer, 1, 2).generation == 1  # the new store's first exchange, not the old one's second
    closing.join(10)
    with pytest.raises(RendezvousError, match="went away"):
        lingering.get("k", 1)
    for store in (lingering, newcomer, new):
        store.close(wait=False)


def _resident_mib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


def test_a_frame_that_claims_a_huge_value_commits_no_memory_until_it_arrives():
    """The server allocated a value's claimed length before reading it: a few bytes claiming
    1 GiB (garbage, or a peer killed mid-send) committed 1 GiB of rank 0's memory per connection."""
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=2)
    before = _resident_mib()
    with socket.create_connection(("127.0.0.1", server.port), timeout=3) as sock:
        sock.sendall(_frame(b"S", b"k", b"")[:-8] + (1 << 30).to_bytes(8, "big") + b"x")
        time.sleep(0.5)
        grown = _resident_mib() - before
    server.close()
    assert grown < 128
    assert _store_threads() == []


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout": 0}, "timeout must be a finite number of seconds above 0, at most 1e+06 (11 days), got 0"),
    ({"device": "0"}, "device: expected a CUDA device ordinal (an int), got '0'"),
    ({"heap_bytes": 4096}, "heap_bytes: expected an int of at least 1048576 (1 MiB), got 4096"),
])
def test_from_env_checks_its_arguments_before_it_waits_for_rank_0(monkeypatch, kwargs, message):
    """A rank other than 0 connected to the store first: it waited for rank 0 (300 s) before its
    device="0" was refused, and timeout=0 was read as 300 s for that wait."""
    from purlinc.runtime.communicator import Communicator
    from purlinc.runtime.errors import ArgumentError

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # no rank 0 serves it
    raised = []

    def call():
        try:
            Communicator.from_env(**kwargs)
        except Exception as error:  # noqa: BLE001 -- checked below
            raised.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(5)
    assert not caller.is_alive(), "from_env waited for rank 0 before checking its arguments"
    assert isinstance(raised[0], ArgumentError) and message in raised[0].message


def test_a_rounds_bound_holds_for_the_whole_round_not_for_each_peer(tmp_path):
    """Each peer's wait had a bound of its own: ranks arriving one after another, each just
    inside the bound after the one before, held rank 0 three bounds long (2.1 s under 1 s), and
    it gathered as if all were in time."""
    store = FileStore(tmp_path, timeout=1)
    exchanges = [Exchange(store, rank, 4, timeout=1) for rank in range(4)]
    late = [0, 0.7, 1.4, 2.1]
    began = time.monotonic()

    def arrive(rank):
        time.sleep(late[rank])
        return exchanges[rank]

    results = _gather_in_threads([lambda obj, r=r: arrive(r)(obj) for r in range(4)], list(range(4)))
    assert isinstance(results[0], RendezvousTimeout)
    # rank 2 had joined (its Exchange was made) but wrote nothing in time: not "never arrived"
    assert ("rank 0 waited 1 s for rank 2 of 4, which joined this store but did not write this round's record in "
            "time (late, or it exited or crashed)") in results[0].message
    assert time.monotonic() - began < 3.5
    assert results[3] == [0, 1, 2, 3]  # every record was there when the last rank came


def test_records_already_written_are_read_after_the_rounds_bound_ran_out(tmp_path):
    """A slow store used the whole bound on the first peer's read: the others' records, there
    all along, are still read (a wait of at least a moment), not reported as missing."""
    class Slow(FileStore):
        def get(self, key, timeout=None):
            if key.endswith("/0"):
                time.sleep(1.2)
            return super().get(key, timeout)

    store = Slow(tmp_path, timeout=1)
    exchanges = [Exchange(store, rank, 3, timeout=1) for rank in range(3)]
    for rank in (1, 2):
        store.set(f"{exchanges[rank].base}/0/{rank}", exchanges[rank]._record(rank))
    assert exchanges[0](0) == [0, 1, 2]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this system has no IPv6 loopback (::1) to serve on")
def test_an_ipv6_master_addr_is_served_in_its_own_address_family():
    """MASTER_ADDR=::1 (which env_info takes) was bound as an IPv4 address: rank 0 failed with
    'Address family for hostname not supported' and a note that another job held the port."""
    server = TCPStore("::1", 0, is_server=True, timeout=2)
    peer = TCPStore("::1", server.port, timeout=2)
    peer.set("k", b"v")
    assert server.get("k") == b"v"
    peer.close()
    server.close()


def test_an_address_rank_0_cannot_serve_on_is_not_blamed_on_the_port():
    with pytest.raises(RendezvousError) as info:
        TCPStore("no-such-host.invalid", 0, is_server=True, timeout=1)
    assert "cannot serve the rendezvous store on no-such-host.invalid:0" in info.value.message
    assert info.value.notes == ("MASTER_ADDR must name this host (rank 0's), where its store serves",)
    assert not [t for t in threading.enumerate() if t.name == "purlin-store"]
