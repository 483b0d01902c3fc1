"""Start-up without torch: a key-value store and an all-gather over it, standard library only.

A communicator needs one thing from its bootstrap: every rank's small host-side objects
(the heap's CUDA IPC handle, agreement hashes), in rank order.  torch.distributed gives that
through a gloo group; here two stores give it without torch, so CuPy (or plain driver) processes
can form a communicator:

- :class:`TCPStore`: rank 0 serves a dict on ``MASTER_ADDR:MASTER_PORT`` (a thread in its
  process); every rank, rank 0 included, is a client.  Requests are length-prefixed frames.
- :class:`FileStore`: one file per key in a directory every rank can see (a shared or local
  file system), written to a temporary name and renamed into place.

:class:`Exchange` builds ``allgather(obj)`` on either: round ``n`` puts ``obj`` under
``<prefix>/g<generation>/<n>/<rank>``, reads every rank's key, and each rank deletes its key of
round ``n - 2`` (which every peer has read by then).  The generation counts the Exchanges a
rank made on the store, so a communicator made again on one store never reads its
predecessor's rounds.
Objects travel as pickles of plain data only (tuples, lists, dicts, sets, str, bytes, numbers): the
unpickler refuses every global, so a peer cannot make this process import or call anything, and
the sender refuses anything else (an ArgumentError) before it writes.

Every wait is bounded (``timeout`` seconds; :func:`purlinc.runtime.rendezvous.env_info` reads
the usual variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
and ends in :class:`RendezvousTimeout` naming the key, the rank waited for and the address.
"""

from __future__ import annotations

import atexit
import errno
import io
import operator
import os
import pickle
import socket
import socketserver
import stat
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from purlinc import settings
from purlinc.errors import PurlinError
from purlinc.runtime.errors import ArgumentError, MismatchError

DEFAULT_TIMEOUT_S = 300.0
MOST_TIMEOUT_S = settings.MOST_WAIT_S  # as PURLIN_WAIT_TIMEOUT_S

# A frame's key and value are bounded, on both ends: a length read from a stranger's bytes (an
# HTTP server on MASTER_PORT answered b"HTTP/1.1 ...", a length of 6 * 10^18) was allocated as
# given (MemoryError), and garbage sent to rank 0's server did the same there.
MAX_KEY_BYTES = 1 << 16
MAX_VALUE_BYTES = 1 << 30

# one request: op (1 byte), key length (4), key, value length (8), value
_SET, _GET, _ADD, _DELETE, _PING = b"S", b"G", b"A", b"D", b"P"
# one reply: status (1 byte), value length (8), value
_OK, _MISSING, _BAD = b"K", b"M", b"E"


class RendezvousError(PurlinError):
    """The ranks could not meet: bad environment variables, an unreachable store, bad data."""


class RendezvousArgumentError(RendezvousError, ArgumentError):
    """A store's or an Exchange's argument is wrong (a directory, key, value, delta, timeout, port,
    rank); nothing was written.  Both classes: a launcher script catches RendezvousError around its
    set-up, and the runtime's callers catch ArgumentError for every bad argument."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """A bounded wait of the rendezvous ran out (a rank never arrived or never wrote its key)."""


class RendezvousMismatch(RendezvousError, MismatchError):
    """A peer's record says it belongs to another world (another WORLD_SIZE, another rank), or
    the store holds something that is not a Purlin record under the exchange's keys."""


# ---------------------------------------------------------------------------------------------
# environment


@dataclass(frozen=True, slots=True)
class EnvInfo:
    """What the usual launcher variables say about this process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


# The most ranks (and the largest LOCAL_RANK or MASTER_PORT) the environment may name: a million,
# ten times the largest jobs run; WORLD_SIZE=10**23 was taken as given.
MOST_RANKS = 1 << 20


def _int_var(environ: Mapping[str, str], name: str, default: str | None = None) -> int:
    """A whole number in decimal digits, as the PURLIN_* settings read theirs: int() alone read
    RANK=1_0 as 10 (and "+3", or Unicode digits), which no shell user means."""
    raw = environ.get(name, default)
    if raw is None:
        raise RendezvousError(f"environment variable {name} is not set",
                              notes=("a launcher (torchrun, mpirun, a script) sets RANK, WORLD_SIZE, LOCAL_RANK, "
                                     "MASTER_ADDR and MASTER_PORT for every process",))
    digits = raw.strip()
    if not small_digits(digits):
        raise RendezvousError(f"environment variable {name} must be an integer, got {raw!r}: expected decimal "
                              f"digits only, a number from 0 to {MOST_RANKS:,}")
    return int(digits)


def small_digits(text: str) -> bool:
    """Whether ``text`` is ASCII digits of a number at most MOST_RANKS (its length checked first:
    int() refuses strings of more than 4,300 digits with a ValueError of its own)."""
    if not (text.isascii() and text.isdigit()):
        return False
    significant = text.lstrip("0") or "0"
    return len(significant) <= len(str(MOST_RANKS)) and int(significant) <= MOST_RANKS


def env_info(environ: Mapping[str, str] | None = None) -> EnvInfo:
    """Rank, world size, local rank and the store's address from the environment."""
    environ = os.environ if environ is None else environ
    rank = _int_var(environ, "RANK")
    world = _int_var(environ, "WORLD_SIZE")
    local = _int_var(environ, "LOCAL_RANK", str(rank))
    port = _int_var(environ, "MASTER_PORT", "29500")
    addr = environ.get("MASTER_ADDR", "127.0.0.1").strip()  # spaces around it, as around the integers
    if not addr:  # set but empty: the store refused "host ''", naming no variable
        raise RendezvousError("environment variable MASTER_ADDR is empty: expected the host name or address of "
                              "rank 0 (where its store serves), or leave it unset for 127.0.0.1")
    host, colon, digits = addr.rpartition(":")
    if colon and digits.isascii() and digits.isdigit() and ":" not in host:  # an IPv6 address has several
        # a host name or IPv4 address with a port: the lookup fails only once the whole timeout has passed
        raise RendezvousError(f"MASTER_ADDR={addr!r} names a port: expected the host alone, with the port in "
                              f"MASTER_PORT (MASTER_ADDR={host} MASTER_PORT={digits})")
    if world < 1:
        raise RendezvousError(f"WORLD_SIZE must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise RendezvousError(f"RANK must be in [0, {world}) (WORLD_SIZE={world}), got {rank}")
    if not 0 <= port < 65536:
        raise RendezvousError(f"MASTER_PORT must be a TCP port (0..65535), got {port}")
    if port == 0 and world > 1:  # rank 0 would serve on a port of the system's choosing, which no peer knows
        raise RendezvousError("MASTER_PORT=0 lets the system pick rank 0's port, which the other ranks cannot "
                              "know: give a fixed port", notes=("0 serves only a world of one",))
    return EnvInfo(rank, world, local, addr, port)


# ---------------------------------------------------------------------------------------------
# plain-data pickles


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # noqa: D401 - the one hook that matters
        raise RendezvousError(f"rendezvous data may hold only plain values; refused {module}.{name}")


def dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# What pickles without a global, and so what loads() reads back (bytearray, set and frozenset
# have opcodes of their own since protocol 4 and 5).  Exact types: a subclass of int or dict (an
# IntEnum, a namedtuple, an OrderedDict) pickles as a reference to its class.
_PLAIN_VALUES = (type(None), bool, int, float, str, bytes, bytearray)
_PLAIN_CONTAINERS = (tuple, list, dict, set, frozenset)
PLAIN_DATA = ("None, bool, int, float, str, bytes, bytearray, and tuples, lists, dicts, sets and frozensets "
              "of them")


def check_plain(obj) -> None:
    """Refuse ``obj`` (ArgumentError) unless every value in it is plain data: a peer's loads()
    refuses the rest, and the sender's own read-back called its record "not a Purlin record"
    (a NumPy integer), or pickle failed with a bare AttributeError (a lambda)."""
    found = _first_unplain(obj)
    if found is None:
        return
    where, value = found
    raise ArgumentError(
        f"allgather: {where} is a {_type_name(value)} ({_shown(value)}), which the ranks cannot exchange: "
        f"expected plain data only ({PLAIN_DATA})",
        notes=("convert it first (int(x), float(x), array.tolist(), bytes(buffer)): the ranks read each other's "
               "records with an unpickler that refuses every class, so a peer cannot make them import or call "
               "anything",))


def _first_unplain(obj) -> tuple[str, object] | None:
    """Where the first value that is not plain data sits in ``obj`` (a path such as
    "obj['count'][2]") and the value; None when there is none.  A walk with a stack, not
    recursion, and each container visited once: a list that holds itself pickles (the memo)."""
    stack, seen = [("obj", obj)], set()
    while stack:
        where, value = stack.pop()
        kind = type(value)
        if kind in _PLAIN_VALUES:
            continue
        if kind not in _PLAIN_CONTAINERS:
            return where, value
        if id(value) not in seen:
            seen.add(id(value))
            stack.extend(reversed(list(_members(where, value))))  # reversed: the first in order is found first
    return None


def _members(where: str, container):
    """(path, value) of each member of a plain container; a dict gives each key, then its value."""
    if type(container) is dict:
        for key, value in container.items():
            yield f"a key of {where}", key
            yield f"{where}[{_shown(key)}]", value
    elif type(container) in (tuple, list):
        for index, value in enumerate(container):
            yield f"{where}[{index}]", value
    else:
        for value in container:
            yield f"a member of {where}", value


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _shown(value, most: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."


def loads(data: bytes):
    return _PlainUnpickler(io.BytesIO(data)).load()


# ---------------------------------------------------------------------------------------------
# TCP store


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, held only as they arrive: a buffer of ``n`` allocated up front let a frame of
    a few bytes that claims a 1 GiB value (garbage, or a peer that dies mid-send) commit 1 GiB
    of rank 0's memory per connection."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the rendezvous peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _Table:
    """The server's dict, with a condition so a GET can wait for its key."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.clients: set[socket.socket] = set()  # the connections open now
        self.handlers: list[threading.Thread] = []  # the threads serving them (and any still ending)
        self.closed = False

    def joined(self, sock: socket.socket) -> None:
        with self.cond:
            self.clients.add(sock)
            self.handlers = [thread for thread in self.handlers if thread.is_alive()]
            self.handlers.append(threading.current_thread())
            if self.closed:  # accepted just before the store closed
                _hang_up(sock)

    def left(self, sock: socket.socket) -> None:
        with self.cond:
            self.clients.discard(sock)
            self.cond.notify_all()

    def wait_clients_gone(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.clients, timeout)

    def close(self) -> list[threading.Thread]:
        """End the store: every waiting GET returns, and every connection still open is shut
        down (its handler then returns).  The handler threads, to join."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            clients, handlers = list(self.clients), list(self.handlers)
        for sock in clients:
            _hang_up(sock)
        return handlers

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while key not in self.data:
                left = deadline - time.monotonic()
                if self.closed:
                    raise ConnectionError("the store was closed")
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.data[key]

    def add(self, key: str, delta: int) -> int:
        with self.cond:
            value = int(self.data.get(key, b"0")) + delta
            self.data[key] = str(value).encode()
            self.cond.notify_all()
            return value

    def delete(self, keys: list[str]) -> None:
        with self.cond:
            for key in keys:
                self.data.pop(key, None)


def _hang_up(sock: socket.socket) -> None:
    """Shut a served connection down: its handler's read returns, and the client hears EOF."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # the peer hung up meanwhile
        pass


class _Handler(socketserver.BaseRequestHandler):
    def setup(self):
        self.server.table.joined(self.request)  # type: ignore[attr-defined]

    def finish(self):
        self.server.table.left(self.request)  # type: ignore[attr-defined]

    def handle(self):
        table: _Table = self.server.table  # type: ignore[attr-defined]
        sock = self.request
        while True:
            try:
                op = sock.recv(1)
                if not op:
                    return
                (klen,) = struct.unpack("!I", _recv_exact(sock, 4))
                too_big = _too_big("key", klen, MAX_KEY_BYTES)
                if not too_big:
                    key = _recv_exact(sock, klen)
                    (vlen,) = struct.unpack("!Q", _recv_exact(sock, 8))
                    too_big = _too_big("value", vlen, MAX_VALUE_BYTES)
                if too_big:  # not a request of ours: say so and hang up (the stream cannot be resynchronized)
                    sock.sendall(_BAD + struct.pack("!Q", len(too_big)) + too_big)
                    return
                value = _recv_exact(sock, vlen)
            except (ConnectionError, OSError):
                return
            try:
                status, reply = _serve(table, op, key.decode(), value)
            except ConnectionError:  # the store was closed during a GET's wait: hang up, answer nothing
                return
            except Exception as error:  # noqa: BLE001 -- a bad request (add to a non-number, a bad frame):
                # answered, not fatal to the connection, so the client hears why
                status, reply = _BAD, f"{type(error).__name__}: {error}".encode()
            try:
                sock.sendall(status + struct.pack("!Q", len(reply)) + reply)
            except OSError:
                return


def _too_big(what: str, n: int, most: int) -> bytes:
    return f"a request's {what} of {n:,} bytes is past the store's limit of {most:,}".encode() if n > most else b""


def _serve(table: "_Table", op: bytes, key: str, value: bytes) -> tuple[bytes, bytes]:
    """One request's (status, reply)."""
    if op == _SET:
        table.set(key, value)
    elif op == _GET:
        wait = float(value.decode())
        if not 0 <= wait <= MOST_TIMEOUT_S:  # NaN spun the handler forever (a wait of NaN never ends)
            raise ValueError(f"a GET waits 0 to {MOST_TIMEOUT_S:g} s, not {value[:40]!r}")
        found = table.get(key, wait)
        return (_MISSING, b"") if found is None else (_OK, found)
    elif op == _ADD:
        return _OK, str(table.add(key, int(value.decode()))).encode()
    elif op == _DELETE:
        table.delete(loads(value))
    elif op != _PING:
        return _BAD, f"unknown request {op!r}".encode()
    return _OK, b""


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's backlog is 5: when 64 ranks connected at once, the kernel dropped the
    # connections past it, and their first requests waited on TCP retransmits (one exchange of
    # 64 threads took 15 s; of 128, past a 30 s timeout).
    request_queue_size = 4096  # the kernel caps it (net.core.somaxconn)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _serve_on(host: str, port: int) -> _Server:
    """Rank 0's server, bound to ``host`` in its own address family: an IPv6 address such as
    MASTER_ADDR=::1 was bound as IPv4 ("Address family for hostname not supported"), with a
    note that another job may hold the port."""
    try:
        # IPv4 wherever the host has an IPv4 address (as before: a name such as localhost may
        # list ::1 first, and binding there alone would change where a peer must connect); IPv6
        # for a host that has none (an IPv6 literal)
        families = {info[0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        ipv6_only = socket.AF_INET not in families and socket.AF_INET6 in families
        return (_Server6 if ipv6_only else _Server)((host, port), _Handler)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            why = "another job may hold MASTER_PORT; pick a free one"
        else:  # a name that does not resolve, or an address of another host
            why = "MASTER_ADDR must name this host (rank 0's), where its store serves"
        raise RendezvousError(f"cannot serve the rendezvous store on {host}:{port}: {error}", notes=(why,)) from None


def _seconds(what: str, value) -> float:
    """A timeout: a finite number of seconds above 0 (NaN never compares past a deadline, so a
    wait bounded by it would never end; 0 or less would fail before trying), at most
    MOST_TIMEOUT_S (1e300 s reached the server's clock as an OverflowError)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        seconds = float("nan")
    if isinstance(value, bool) or not (0 < seconds <= MOST_TIMEOUT_S):
        raise RendezvousArgumentError(f"{what} must be a finite number of seconds above 0, at most "
                                      f"{MOST_TIMEOUT_S:g} (11 days), got {value!r}")
    return seconds


def checked_timeout(value) -> float:
    """A caller's timeout in seconds, checked as every store and Exchange checks theirs."""
    return _seconds("timeout", value)


def _key(key) -> str:
    """A store key: a non-empty string of UTF-8 text (FileStore makes a file name of it, TCPStore a
    frame; both encode it as UTF-8, which a lone surrogate such as '\\udcff' fails)."""
    if not isinstance(key, str) or not key or "\0" in key:
        raise RendezvousArgumentError(f"a store key is a non-empty string without NUL, got {key!r}")
    try:
        size = len(key.encode())
    except UnicodeEncodeError as error:
        raise RendezvousArgumentError(
            f"a store key is UTF-8 text, got {_shown(key)} with the lone surrogate {key[error.start]!r} at index "
            f"{error.start}") from None
    if size > MAX_KEY_BYTES:
        raise RendezvousArgumentError(f"a store key is at most {MAX_KEY_BYTES:,} bytes, got {size:,}")
    return key


def _keys(keys) -> list[str]:
    """Keys to delete: a list of keys (a bare string would be read as its characters)."""
    if isinstance(keys, (str, bytes)):
        raise RendezvousArgumentError(f"delete takes a list of keys, got the string {keys!r}")
    return [_key(k) for k in keys]


def _value(value) -> bytes:
    """A store value: bytes (``bytes(3)`` would store three zero bytes, not "3"), at most MAX_VALUE_BYTES."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise RendezvousArgumentError(f"a store value is bytes, got {type(value).__name__}")
    size = memoryview(value).nbytes
    if size > MAX_VALUE_BYTES:  # before any copy
        raise RendezvousArgumentError(f"a store value is at most {MAX_VALUE_BYTES:,} bytes, got {size:,}",
                                      notes=("the rendezvous carries small host-side records; send data through a "
                                             "collective",))
    return bytes(value)


def _delta(delta) -> int:
    """add's delta: an integer (int() read "5" as 5 and cut 1.5 to 1; a bool is no count)."""
    try:
        if not isinstance(delta, bool):
            return operator.index(delta)  # an int, or a NumPy integer
    except TypeError:
        pass
    raise RendezvousArgumentError(f"add: delta must be an integer, got {_shown(delta)} ({_type_name(delta)})")


def _port(value, *, server: bool) -> int:
    """A TCP port: 1..65535 (0 too for a server: the system picks a free one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not (0 if server else 1) <= value <= 65535:
        allowed = "0 (any free port) or 1..65535" if server else "1..65535"
        raise RendezvousArgumentError(f"port must be an integer in {allowed}, got {value!r}")
    return value


class _Foreign(Exception):
    """A reply that no rendezvous store sends (the bytes it began with)."""


class TCPStore:
    """A client of the store at ``host:port``; with ``is_server=True`` it also serves it.

    ``port=0`` with ``is_server=True`` picks a free port (``store.port`` says which).
    """

    def __init__(self, host: str, port: int, *, is_server: bool = False, timeout: float = DEFAULT_TIMEOUT_S):
        if not isinstance(host, str) or not host.strip():
            raise RendezvousArgumentError(f"host must be a host name or address, got {host!r}")
        self.host, self.timeout = host, _seconds("timeout", timeout)
        port = _port(port, server=is_server)
        self._server: _Server | None = None
        if is_server:
            self._server = _serve_on(host, port)
            self._server.table = _Table()  # type: ignore[attr-defined]
            port = self._server.server_address[1]
            threading.Thread(target=self._server.serve_forever, name="purlin-store", daemon=True).start()
            # The server lives in rank 0's process: at exit it waits (bounded) for the other
            # ranks to hang up, so a fast rank 0 does not pull the store from under them.
            atexit.register(self.close)
        self.port = port
        self._lock = threading.Lock()
        self._broken: str | None = None  # why the connection was dropped (a half-read reply leaves it unusable)
        try:
            self._sock = self._connect()
        except BaseException:
            self._stop_serving()  # a server nobody can reach: no thread or port left behind
            raise

    def __repr__(self) -> str:
        return f"TCPStore({self.host}:{self.port}{', server' if self._server else ''})"

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        delay = 0.01
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(None)
                return sock
            except OSError as error:  # the server (rank 0) may not be up yet
                last = error
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        raise RendezvousTimeout(
            f"could not reach the rendezvous store at {self.host}:{self.port} within {self.timeout:g} s ({last})",
            notes=("rank 0 serves it: is rank 0 running, and do all ranks have the same MASTER_ADDR and MASTER_PORT?",),
        )

    def _request(self, op: bytes, key: str, value: bytes = b"", wait: float = 0.0) -> tuple[bytes, bytes]:
        k = key.encode()
        # The server answers a GET within ``wait``, anything else at once; the socket's bound
        # allows that plus a margin (30 s, or the store's timeout if shorter: a listener that
        # never answers held a rank 30 s past a 3 s timeout).
        bound = wait + min(self.timeout, 30.0)
        with self._lock:
            if self._broken is not None:
                raise RendezvousError(f"the connection to the rendezvous store at {self.host}:{self.port} was "
                                      f"dropped after an earlier failure ({self._broken}); a request for {key!r} "
                                      "cannot be made on it")
            try:
                self._sock.settimeout(bound)
                self._sock.sendall(op + struct.pack("!I", len(k)) + k + struct.pack("!Q", len(value)) + value)
                status = _recv_exact(self._sock, 9)
                status, (n,) = status[:1], struct.unpack("!Q", status[1:])
                if status not in (_OK, _MISSING, _BAD) or n > MAX_VALUE_BYTES + MAX_KEY_BYTES:
                    raise _Foreign(status + struct.pack("!Q", n))
                reply = _recv_exact(self._sock, n)
            except _Foreign as foreign:
                self._drop("its answer was not a rendezvous store's")
                raise RendezvousError(
                    f"{self.host}:{self.port} did not answer a request for {key!r} as a Purlin rendezvous store "
                    f"does (its reply began {foreign.args[0]!r})",
                    notes=("another service may listen on MASTER_ADDR:MASTER_PORT: pick a free port",)) from None
            except (socket.timeout, TimeoutError):
                self._drop(f"no answer within {bound:g} s")
                raise RendezvousTimeout(
                    f"the rendezvous store at {self.host}:{self.port} did not answer a request for {key!r} "
                    f"within {bound:g} s",
                    notes=("rank 0 serves the store: is it stopped, or does another service listen on "
                           "MASTER_ADDR:MASTER_PORT?",)) from None
            except (OSError, ConnectionError) as error:
                self._drop(str(error))
                raise RendezvousError(f"the rendezvous store at {self.host}:{self.port} went away during "
                                      f"a request for {key!r}: {error}",
                                      notes=("rank 0 serves the store: did it exit or crash?",)) from None
        if status == _BAD:
            raise RendezvousError(f"the rendezvous store at {self.host}:{self.port} refused a request for "
                                  f"{key!r}: {reply.decode(errors='replace')}")
        return status, reply

    def _drop(self, why: str) -> None:
        self._broken = why
        self._sock.close()

    def set(self, key: str, value: bytes) -> None:
        self._request(_SET, _key(key), _value(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self.timeout if timeout is None else _seconds("timeout", timeout)
        status, value = self._request(_GET, _key(key), repr(wait).encode(), wait)
        if status == _MISSING:
            raise RendezvousTimeout(f"key {key!r} did not appear in the store at {self.host}:{self.port} "
                                    f"within {wait:g} s")
        return value

    def add(self, key: str, delta: int) -> int:
        return int(self._request(_ADD, _key(key), str(_delta(delta)).encode())[1])

    def delete(self, keys: list[str]) -> None:
        self._request(_DELETE, "", dumps(_keys(keys)))

    def close(self, *, wait: bool = True) -> None:
        """Hang up; the serving rank first waits (up to ``timeout``; ``wait=False``: not at all,
        after a failure) for every client to hang up."""
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
        self._stop_serving(wait=wait)

    def _stop_serving(self, wait: bool = False) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        # The port first: a rank of the next world on it connected to this dead one while it
        # waited for its clients, and read this world's counters.
        server.shutdown()
        server.server_close()
        table: _Table = server.table  # type: ignore[attr-defined]
        if wait:
            table.wait_clients_gone(self.timeout)
        # Then whoever is still connected (a peer that never hung up): its handler served this
        # world's table for as long as the process lived, so a peer's GET waited out its whole
        # timeout instead of hearing that rank 0's store is gone.
        deadline = time.monotonic() + 5.0
        for thread in table.close():
            thread.join(max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------------------------------------
# file store


def _directory(directory) -> Path:
    """FileStore's directory: a str or os.PathLike (Path(None) was a bare TypeError, and Path("")
    the working directory, which no rank means)."""
    path = os.fspath(directory) if isinstance(directory, os.PathLike) else directory
    if not isinstance(path, str) or not path:
        raise RendezvousArgumentError(f"FileStore: directory must be a path (a non-empty str or os.PathLike) every "
                                      f"rank can see, got {_shown(directory)}")
    return Path(path)


class FileStore:
    """Keys as files under ``directory`` (created if missing); every rank must see the same one."""

    def __init__(self, directory: str | os.PathLike, *, timeout: float = DEFAULT_TIMEOUT_S):
        self.timeout = _seconds("timeout", timeout)
        self.directory = _directory(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file there, a missing mount, no permission
            why = ("it is a file, not a directory" if error.errno == errno.EEXIST and self.directory.exists()
                   else error.strerror or str(error))
            raise RendezvousError(f"cannot use {self.directory} as a file store: {why}") from None

    def __repr__(self) -> str:
        return f"FileStore({self.directory})"

    def _path(self, key: str) -> Path:
        """The key's file: '%' and '/' escaped, a leading '.' too (so "." and ".." stay inside the
        directory, and no key meets the store's own dot files), a long name shortened by a digest."""
        name = _key(key).replace("%", "%25").replace("/", "%2F")
        if name.startswith("."):
            name = "%2E" + name[1:]
        if len(name.encode()) > 200:  # file names end at 255 bytes; "%%" never occurs in an escaped key
            import hashlib

            name = name[:100] + "%%" + hashlib.sha256(name.encode()).hexdigest()
        return self.directory / name

    def _unusable(self, op: str, key: str, path: Path, error: OSError) -> RendezvousError:
        """The error for a key whose file cannot be read or written (a directory in its place, a
        full disk): IsADirectoryError and the like named neither the key nor the store."""
        return RendezvousError(
            f"{op}: key {key!r} of the file store {self.directory} cannot be used: its file {path} cannot be read "
            f"or written ({error.strerror or error})",
            notes=("is something else in its place (a directory, another user's file)? Give Purlin a directory of its "
                   "own; or is the directory's file system full or gone?",))

    def _read(self, op: str, key: str, path: Path) -> bytes | None:
        """The key's value, or None while its file is missing.  Opened without blocking and read
        only if it is a regular file: a named pipe in its place blocked the read past any timeout."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self._unusable(op, key, path, error) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as handle:
                return handle.read()
        except OSError as error:
            raise self._unusable(op, key, path, error) from None
        finally:
            os.close(fd)

    def set(self, key: str, value: bytes) -> None:
        path, data = self._path(key), _value(value)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)  # readers see the whole value or nothing
        except OSError as error:
            raise self._unusable("set", key, path, error) from None
        finally:
            tmp.unlink(missing_ok=True)  # after a failed write or rename; gone already after a good one

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self.timeout if timeout is None else _seconds("timeout", timeout)
        deadline = time.monotonic() + wait
        path, delay = self._path(key), 0.001
        while True:
            value = self._read("get", key, path)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(f"key {key!r} did not appear in {self.directory} within {wait:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def add(self, key: str, delta: int) -> int:
        import fcntl

        path, delta = self._path(key), _delta(delta)
        try:
            lock = open(self.directory / ".lock", "a+")
        except OSError as error:  # a directory in its place, a full or gone file system
            raise self._unusable("add", key, self.directory / ".lock", error) from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                held = self._read("add", key, path)
                try:
                    value = 0 if held is None else int(held)
                except ValueError:
                    raise RendezvousError(f"add: key {key!r} holds {held[:40]!r}, not a number") from None
                value += delta
                self.set(key, str(value).encode())
                return value
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def delete(self, keys: list[str]) -> None:
        for key in _keys(keys):
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as error:
                raise self._unusable("delete", key, path, error) from None

    def close(self, *, wait: bool = True) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# all-gather over a store


_RECORD = "purlin-rdv-1"  # the first field of every Exchange record
_LEAST_WAIT_S = 0.05  # a round's wait for a peer once its bound has run out: for a record already there


class Exchange:
    """``exchange(obj)``: every rank's ``obj`` in rank order (the communicator's host collective)."""

    def __init__(self, store, rank: int, world_size: int, *, prefix: str = "purlin", timeout: float | None = None):
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise RendezvousArgumentError(f"{name} must be an integer, got {value!r}")
        if not 0 <= rank < world_size:
            raise RendezvousArgumentError(f"rank {rank} is outside the world of {world_size} ranks")
        missing = [op for op in ("set", "get", "add", "delete") if not callable(getattr(store, op, None))]
        if missing:
            raise RendezvousArgumentError(f"store {store!r} lacks {', '.join(missing)}: expected a TCPStore, a "
                                          "FileStore or another object with set, get, add and delete")
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self.timeout = _seconds("timeout", timeout if timeout is not None else getattr(store, "timeout", DEFAULT_TIMEOUT_S))
        self.round = 0
        # The rounds of each Exchange made on a store under this prefix live under a generation
        # of their own: a communicator made again on the same store (the recovery after a
        # timeout) would otherwise read the rounds its predecessor left there.  Every rank
        # counts the Exchanges it made (in the store, so a restarted process counts on), and
        # ranks that make the same sequence of communicators agree on the generation.
        self.generation = store.add(f"{prefix}/generation/{rank}", 1)
        self.base = f"{prefix}/g{self.generation}"

    def __call__(self, obj) -> list:
        # Refused before anything is written or counted: the ranks stay in step, and the error is
        # an ArgumentError, not a RendezvousError (which stops a communicator: its peers' state
        # would be unknown).  Each record says whose it is: a peer started with another
        # WORLD_SIZE (or writing under another rank's key) was gathered as if it belonged here.
        record = self._record(obj)
        n = self.round
        self.round += 1
        base = f"{self.base}/{n}"
        if n >= 2:
            # Every rank that wrote round n-1 had finished reading round n-2, and we have read
            # all of round n-1: our round n-2 key is dead.  (No request after a round's last
            # read, so rank 0 -- the server -- may leave as soon as it has read.)
            self.store.delete([f"{self.base}/{n - 2}/{self.rank}"])
        self.store.set(f"{base}/{self.rank}", record)
        gathered = []
        # One bound for the round, not one per peer: peers each arriving just inside the bound
        # after the one before held a rank world_size times as long (ranks 1..3 at 1.7 s
        # intervals: 5.1 s under a 2 s timeout).  Past it, a record already written is still read.
        deadline = time.monotonic() + self.timeout
        for peer in range(self.world_size):
            started = time.monotonic()
            wait = max(deadline - started, _LEAST_WAIT_S)
            try:
                data = self.store.get(f"{base}/{peer}", wait)
            except RendezvousTimeout as error:
                waited = time.monotonic() - started
                if waited < 0.9 * wait - 0.05:
                    # Not the bound running out: a store that reports its failures as timeouts
                    # (torch's, when its server -- rank 0's process -- exits) said "never arrived"
                    # of a peer that had written its record, in a wait that lasted 0.05 s of 2.
                    raise RendezvousTimeout(
                        f"rendezvous round {n}: rank {self.rank}'s wait for rank {peer} of {self.world_size} ended "
                        f"after {waited:.2g} s of its {self.timeout:g} s bound, when the store failed: "
                        f"{error.message.splitlines()[0]}",
                        notes=("the store's server runs in rank 0's process: did it exit or crash?",)) from None
                raise RendezvousTimeout(
                    f"rendezvous round {n}: rank {self.rank} waited {self.timeout:g} s for rank {peer} of "
                    f"{self.world_size}, {self._absence(peer)} (store {self.store!r})",
                    notes=("every rank must make the same sequence of communicator calls (creation, loads, "
                           "first calls of each dtype)",),
                ) from None
            gathered.append(self._unwrap(n, peer, data))
        return gathered

    def _record(self, obj) -> bytes:
        """This rank's record of ``obj``, once ``obj`` is shown to be plain data of a size the
        store takes."""
        check_plain(obj)
        data = dumps((_RECORD, self.world_size, self.rank, obj))
        if len(data) > MAX_VALUE_BYTES:
            raise ArgumentError(f"allgather: obj pickles to {len(data):,} bytes, past the store's limit of "
                                f"{MAX_VALUE_BYTES:,}",
                                notes=("the rendezvous carries small host-side records; send data through a "
                                       "collective",))
        return data

    def _unwrap(self, n: int, peer: int, data: bytes):
        """The object in ``peer``'s record of round ``n``, once the record is shown to be a
        record of this world written by ``peer``."""
        try:
            record = loads(data)
        except Exception:  # noqa: BLE001 -- a truncated or foreign value: named below
            record = None
        if not (isinstance(record, tuple) and len(record) == 4 and record[0] == _RECORD):
            raise RendezvousMismatch(
                f"rendezvous round {n}: the store's key {self.base}/{n}/{peer} (rank {peer}'s) holds "
                f"{data[:60]!r}{'...' if len(data) > 60 else ''}, not a Purlin rendezvous record "
                f"(store {self.store!r})",
                notes=("another program uses this store and prefix: give Purlin a store (or prefix) of its own",))
        _, world, rank, obj = record
        if world != self.world_size:
            raise RendezvousMismatch(
                f"rendezvous round {n}: rank {peer} belongs to a world of {world} ranks, but rank {self.rank} "
                f"to one of {self.world_size}: expected WORLD_SIZE={self.world_size} on every rank",
                notes=("every rank must be started with the same WORLD_SIZE",))
        if rank != peer:
            raise RendezvousMismatch(
                f"rendezvous round {n}: rank {peer}'s key holds a record of rank {rank}: expected rank {peer}",
                notes=("another program writes this store's keys",))
        return obj

    def _absence(self, peer: int) -> str:
        """Why ``peer`` is not in this generation, as far as the store's counters say: its key of
        this round never came, or it joined another generation (a second process started as one
        rank, or a store left by an earlier run on the same address or directory)."""
        try:
            theirs = int(self.store.add(f"{self.prefix}/generation/{peer}", 0))
        except Exception:  # noqa: BLE001 -- the diagnosis is best effort; the timeout stands
            return "which never arrived"
        if theirs == 0:
            return "which never arrived (it never joined this store)"
        if theirs == self.generation:  # it joined this generation: not a rank that never started
            return "which joined this store but did not write this round's record in time (late, or it exited or crashed)"
        return (f"which joined another generation of this store: rank {peer} made {theirs} exchange(s) on it, "
                f"rank {self.rank} {self.generation} (two processes started as one rank, a store an earlier "
                "run left on this address or directory, or ranks that made different numbers of communicators)")

    def barrier(self) -> None:
        self(None)


def store_from_env(info: EnvInfo, *, timeout: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    """Rank 0 serves on MASTER_ADDR:MASTER_PORT; every rank connects to it."""
    return TCPStore(info.master_addr, info.master_port, is_server=info.rank == 0, timeout=timeout)
