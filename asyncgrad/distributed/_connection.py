"""Connections: non-blocking sockets driven by trio's I/O waits, length-prefixed frames, HMAC handshakes.

A `Connection` owns one stream socket (TCP with TCP_NODELAY, or a Unix socket). Frames are sent whole and
in order: a frame goes straight into the socket when nothing is queued before it (no task switch for a
small call), the rest of it is written by the connection's sender task. Receiving reads through a small
buffer, except the payload of large tensors, which is received straight into its destination.

Before any frame, both ends prove the cluster secret to each other (as `multiprocessing.connection`
does, with HMAC-SHA256 over random challenges and `hmac.compare_digest`, but without pickle): the
listening end challenges first, and reads nothing else from a peer that has not answered.
"""

from __future__ import annotations

import array
import collections
import errno
import hmac
import logging
import os
import secrets
import socket
from typing import Any

import trio

from . import _shm
from ._errors import AuthenticationError, ProtocolError
from ._wire import HEADER, HEADER_SIZE, check_header

log = logging.getLogger("asyncgrad.distributed")

_RBUF = 256 << 10  # receive buffer; payload reads of at least _DIRECT bytes bypass it
_DIRECT = 64 << 10
_IOV_MAX = 512
MAX_SEGMENTS = 64  # shared segments passed with one frame (the rest of its buffers go in-band)
_CMSG_SPACE = socket.CMSG_SPACE(MAX_SEGMENTS * 4)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # a plain int: an IntFlag test costs microseconds

_MAGIC = b"AGRPC/2 "  # 8 bytes: protocol and version (2: inline values in a binary layout)
_CHALLENGE_BYTES = 32
_DIGEST_BYTES = 32
_OK = b"OK"
_NO = b"NO"
HANDSHAKE_TIMEOUT = 10.0

# frames sent or received by this process's connections so far (`_spin` spins only right after traffic)
ACTIVITY = [0]


class ConnectionClosed(Exception):
    """The connection is closed (by us, by the peer, or because it broke)."""


class Connection:
    """One authenticated byte stream to a peer; frames in, frames out."""

    def __init__(self, sock: socket.socket, peer: str, *, max_meta_bytes: int, max_frame_bytes: int) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        # a Unix socket carries file descriptors: large buffers then travel as shared segments
        self.fd_passing = sock.family == socket.AF_UNIX and _shm.available
        self._fds: collections.deque[int] = collections.deque()  # received with frames, not taken yet
        self.peer = peer
        self.max_meta_bytes = max_meta_bytes
        self.max_frame_bytes = max_frame_bytes
        self._rbuf = bytearray(_RBUF)
        self._rview = memoryview(self._rbuf)
        self._rstart = 0
        self._rend = 0
        self._queue: collections.deque[list[Any]] = collections.deque()  # [views, segments] per frame
        self._writing = False
        self._send_lot = trio.lowlevel.ParkingLot()
        self._drain_lot = trio.lowlevel.ParkingLot()
        self.queued_bytes = 0
        self.closed = False
        self.error: BaseException | None = None
        self.frames_sent = 0
        self.frames_received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.waits = 0  # times the reader waited for the socket (a wait is a schedule point)
        self._drained = False  # the last read returned less than asked: the socket is likely empty

    def fileno(self) -> int:
        return self._sock.fileno()

    def __repr__(self) -> str:
        return f"<Connection to {self.peer}{' closed' if self.closed else ''}>"

    # ---- closing -----------------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """Close now: tasks waiting on the socket wake with `ConnectionClosed`."""
        if self.closed:
            return
        self.closed = True
        if error is not None and self.error is None:
            self.error = error
        self._queue.clear()
        self.queued_bytes = 0
        while self._fds:
            os.close(self._fds.popleft())
        try:
            trio.lowlevel.notify_closing(self._sock)
        except RuntimeError:  # not inside a trio run (closing at interpreter exit)
            pass
        self._sock.close()
        self._send_lot.unpark_all()
        self._drain_lot.unpark_all()

    # ---- sending -----------------------------------------------------------------------------------

    def send_nowait(self, parts: list[Any], segments: list[Any] | None = None) -> None:
        """Queue one frame (its parts are sent back to back, nothing in between); the descriptors of
        ``segments`` (shared buffers, Unix sockets only) go with its first byte."""
        if self.closed:
            raise ConnectionClosed(f"the connection to {self.peer} is closed") from self.error
        if len(parts) == 1 and not segments and not self._queue and not self._writing:
            # the common small frame: straight into the socket
            data = parts[0]
            try:
                n = self._sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._broken(e)
                raise ConnectionClosed(f"the connection to {self.peer} broke: {e}") from e
            self.frames_sent += 1
            self.bytes_sent += n
            ACTIVITY[0] += 1
            if n == len(data):
                return
            rest = memoryview(data)[n:]
            rest = rest if rest.format == "B" and rest.ndim == 1 else rest.cast("B")
            self._queue.append([[rest], None])
            self.queued_bytes += rest.nbytes
            self._send_lot.unpark()
            return
        views = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
        views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views if v.nbytes]
        entry = [views, segments or None]
        self.frames_sent += 1
        ACTIVITY[0] += 1
        if not self._queue and not self._writing:
            try:
                self._send_some(entry)
            except OSError as e:
                self._broken(e)
                raise ConnectionClosed(f"the connection to {self.peer} broke: {e}") from e
            if not entry[0]:
                return
        self._queue.append(entry)
        self.queued_bytes += sum(v.nbytes for v in entry[0] or ())
        self._send_lot.unpark()

    def _send_some(self, entry: list[Any]) -> None:
        """Write as much of a frame as the socket takes now; ``entry`` keeps what is left."""
        sock = self._sock
        views = entry[0]
        while views:
            segments = entry[1]
            try:
                if segments:
                    fds = array.array("i", [seg.fd for seg in segments])
                    n = sock.sendmsg(views[:_IOV_MAX], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                    entry[1] = None
                    for seg in segments:  # the peer holds them now; the segments are theirs
                        seg.given_away()
                elif len(views) > 1:
                    n = sock.sendmsg(views[:_IOV_MAX])
                else:
                    n = sock.send(views[0])
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            self.bytes_sent += n
            i = 0
            while i < len(views) and n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            views = views[i:]
            if n:
                views[0] = views[0][n:]
        entry[0] = views

    async def sender(self) -> None:
        """The task writing queued frames; returns when the connection closes."""
        sock = self._sock
        while not self.closed:
            if not self._queue:
                await self._send_lot.park()
                continue
            self._writing = True
            entry = self._queue[0]
            try:
                while entry[0]:
                    before = sum(v.nbytes for v in entry[0])
                    self._send_some(entry)
                    self.queued_bytes -= before - sum(v.nbytes for v in entry[0])
                    if entry[0]:
                        await trio.lowlevel.wait_writable(sock)
            except (OSError, trio.ClosedResourceError) as e:
                self._broken(e)
                return
            finally:
                self._writing = False
            if self._queue:
                self._queue.popleft()
            self._drain_lot.unpark_all()

    async def drain(self, below: int = 0) -> None:
        """Wait until at most ``below`` bytes are queued (all written, by default)."""
        while (self.queued_bytes > below or self._writing) and not self.closed:
            await self._drain_lot.park()
        if self.closed and self.error is not None:
            raise ConnectionClosed(f"the connection to {self.peer} broke") from self.error

    async def send_all(self, data: bytes) -> None:
        """Send raw bytes now and wait until they are written (handshakes only; no frame)."""
        self.frames_sent -= 1
        self.send_nowait([data])
        if self._queue:
            await self._write_queue_here()

    async def _write_queue_here(self) -> None:
        while self._queue and not self.closed:
            entry = self._queue[0]
            try:
                self._send_some(entry)
            except OSError as e:
                self._broken(e)
                raise ConnectionClosed(str(e)) from e
            if entry[0]:
                await trio.lowlevel.wait_writable(self._sock)
            else:
                self._queue.popleft()
        self.queued_bytes = 0

    def _broken(self, e: BaseException) -> None:
        self.close(e)

    # ---- receiving ---------------------------------------------------------------------------------

    async def _fill(self) -> None:
        """Read more bytes into the receive buffer (at least one)."""
        if self.closed:
            raise ConnectionClosed(f"the connection to {self.peer} is closed") from self.error
        if self._rstart == self._rend:
            self._rstart = self._rend = 0
        elif self._rend == len(self._rbuf):
            n = self._rend - self._rstart
            self._rbuf[:n] = self._rbuf[self._rstart : self._rend]
            self._rstart, self._rend = 0, n
        if self._drained:  # the last read took all there was: wait first (saves a failing read)
            self._drained = False
            await self._wait_readable()
        room = len(self._rbuf) - self._rend
        n = await self._recv_some(self._rview[self._rend :])
        self._rend += n
        self.bytes_received += n
        self._drained = n < room

    async def _recv_some(self, view: memoryview) -> int:
        """Receive at least one byte into ``view`` (waiting for the socket as needed); how many."""
        while True:
            try:
                n = self._recv(view)
            except BlockingIOError:
                await self._wait_readable()
                continue
            except InterruptedError:
                continue
            except OSError as e:
                self._broken(e)
                raise ConnectionClosed(f"the connection to {self.peer} broke: {e}") from e
            if n == 0:
                raise ConnectionClosed(f"{self.peer} closed the connection")
            return n

    async def _wait_readable(self) -> None:
        self.waits += 1
        try:
            await trio.lowlevel.wait_readable(self._sock)
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"the connection to {self.peer} is closed") from self.error

    def _recv(self, view: memoryview) -> int:
        if not self.fd_passing:
            return self._sock.recv_into(view)  # type: ignore[no-any-return]
        n, ancdata, flags, _ = self._sock.recvmsg_into([view], _CMSG_SPACE)
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if flags & _MSG_CTRUNC:
            self._broken(ProtocolError("file descriptors were cut off (too many in one frame)"))
            raise OSError("file descriptors were cut off")
        return n  # type: ignore[no-any-return]

    def take_fd(self) -> int:
        """The next file descriptor that came with the frames (a shared segment's)."""
        if not self._fds:
            raise ProtocolError("a frame names a shared segment that did not come with it")
        return self._fds.popleft()

    async def recv_exact(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        if self._rend - self._rstart >= n:
            out = bytes(self._rview[self._rstart : self._rstart + n])
            self._rstart += n
            return out
        if n > len(self._rbuf) // 2:
            buf = bytearray(n)
            await self.recv_into(memoryview(buf))
            return bytes(buf)
        while self._rend - self._rstart < n:
            if len(self._rbuf) - self._rstart < n:  # make room at the end
                k = self._rend - self._rstart
                self._rbuf[:k] = self._rbuf[self._rstart : self._rend]
                self._rstart, self._rend = 0, k
            await self._fill()
        out = bytes(self._rview[self._rstart : self._rstart + n])
        self._rstart += n
        return out

    async def recv_into(self, dest: memoryview) -> None:
        """Fill ``dest`` completely: from the buffer first, then straight from the socket when large."""
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        need = dest.nbytes
        got = 0
        have = self._rend - self._rstart
        if have:
            k = min(have, need)
            dest[:k] = self._rview[self._rstart : self._rstart + k]
            self._rstart += k
            got = k
        while got < need:
            if need - got >= _DIRECT:
                n = await self._recv_some(dest[got:])
                got += n
                self.bytes_received += n
            else:
                await self._fill()
                k = min(self._rend - self._rstart, need - got)
                dest[got : got + k] = self._rview[self._rstart : self._rstart + k]
                self._rstart += k
                got += k

    async def recv_frame_head(self) -> tuple[bytes, bytes, int]:
        """The next frame's message and buffer table, checked against the limits, and its payload size.

        The caller reads the payload next (`recv_into` per buffer).
        """
        while True:  # the usual case: the whole head is (or comes) into the receive buffer
            start = self._rstart
            if self._rend - start >= HEADER_SIZE:
                meta_len, table_len, payload_len = HEADER.unpack_from(self._rbuf, start)
                check_header(meta_len, table_len, payload_len, self.max_meta_bytes, self.max_frame_bytes)
                end = start + HEADER_SIZE + meta_len + table_len
                if end <= self._rend:
                    view = self._rview
                    mid = start + HEADER_SIZE + meta_len
                    meta = bytes(view[start + HEADER_SIZE : mid])
                    table = bytes(view[mid:end]) if table_len else b""
                    self._rstart = end
                    self.frames_received += 1
                    ACTIVITY[0] += 1
                    return meta, table, payload_len
                if end > len(self._rbuf):
                    break  # larger than the space after it: the general path below
            elif start + HEADER_SIZE > len(self._rbuf):
                break
            await self._fill()
        head = await self.recv_exact(HEADER_SIZE)
        meta_len, table_len, payload_len = HEADER.unpack(head)
        check_header(meta_len, table_len, payload_len, self.max_meta_bytes, self.max_frame_bytes)
        meta = await self.recv_exact(meta_len)
        table = await self.recv_exact(table_len) if table_len else b""
        self.frames_received += 1
        ACTIVITY[0] += 1
        return meta, table, payload_len


# ---- addresses, listeners, connecting -----------------------------------------------------------


def parse_address(address: str) -> tuple[int, Any]:
    """``"HOST:PORT"`` / ``"[v6]:PORT"`` -> TCP, ``"unix:/path"`` -> a Unix socket: (family, sockaddr)."""
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[5:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"an address is HOST:PORT or unix:PATH, got {address!r}")
    host = host.strip("[]") or "127.0.0.1"
    return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))


def format_address(family: int, sockaddr: Any) -> str:
    if family == socket.AF_UNIX:
        return f"unix:{sockaddr}"
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Listener:
    """A listening socket (loopback unless told otherwise)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, unix_path: str | None = None) -> None:
        if unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(unix_path)
                os.chmod(unix_path, 0o600)
            except BaseException:
                sock.close()
                raise
            self.unix_path: str | None = unix_path
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
            except BaseException:
                sock.close()
                raise
            self.unix_path = None
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.address = format_address(sock.family, sock.getsockname())
        self.closed = False

    async def accept(self) -> tuple[socket.socket, str]:
        while True:
            try:
                conn, addr = self._sock.accept()
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self._sock)
                except trio.ClosedResourceError:
                    raise ConnectionClosed(f"the listener at {self.address} is closed") from None
                continue
            except OSError as e:
                if self.closed:
                    raise ConnectionClosed(f"the listener at {self.address} is closed") from None
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED):
                    log.error("accept() on %s failed: %s", self.address, e)
                    await trio.sleep(0.1)
                    continue
                raise
            peer = format_address(conn.family, addr) if conn.family != socket.AF_UNIX else "unix peer"
            return conn, peer

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            trio.lowlevel.notify_closing(self._sock)
        except RuntimeError:
            pass
        self._sock.close()
        if self.unix_path is not None:
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass


async def connect(address: str, timeout: float = 10.0) -> socket.socket:
    """A connected non-blocking socket to ``address`` (HOST:PORT or unix:PATH); retries until ``timeout``
    while nobody listens yet."""
    family, sockaddr = parse_address(address)
    if family != socket.AF_UNIX:
        host, port = sockaddr
        try:
            socket.inet_pton(family, host)
        except OSError:  # a host name: resolve it (in a thread; only remote workers connect by name)
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
    with trio.fail_after(timeout):
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                err = sock.connect_ex(sockaddr)
                if err in (errno.EINPROGRESS, errno.EAGAIN):
                    await trio.lowlevel.wait_writable(sock)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            except BaseException:
                sock.close()
                raise
            if err == 0:
                return sock
            sock.close()
            if err in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
                await trio.sleep(0.05)
                continue
            raise OSError(err, f"cannot connect to {address}: {os.strerror(err)}")


# ---- the handshake ------------------------------------------------------------------------------


def _digest(secret: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, role + challenge, "sha256").digest()


async def server_handshake(conn: Connection, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """(listening end) Challenge the peer; answer its challenge. Raises `AuthenticationError` when the
    peer does not know the secret (it is told "NO" and the caller closes the connection)."""
    with trio.fail_after(timeout):
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        await conn.send_all(_MAGIC + challenge)
        reply = await conn.recv_exact(len(_MAGIC) + _DIGEST_BYTES + _CHALLENGE_BYTES)
        if reply[: len(_MAGIC)] != _MAGIC:
            await _refuse(conn)
            raise AuthenticationError(f"{conn.peer} does not speak this protocol")
        digest = reply[len(_MAGIC) : len(_MAGIC) + _DIGEST_BYTES]
        theirs = reply[len(_MAGIC) + _DIGEST_BYTES :]
        if not hmac.compare_digest(digest, _digest(secret, b"client", challenge)):
            await _refuse(conn)
            raise AuthenticationError(f"{conn.peer} did not prove the cluster secret")
        await conn.send_all(_OK + _digest(secret, b"server", theirs))


async def _refuse(conn: Connection) -> None:
    try:
        await conn.send_all(_NO + bytes(_DIGEST_BYTES))
    except ConnectionClosed:
        pass


async def client_handshake(conn: Connection, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """(connecting end) Answer the listener's challenge and check its answer to ours."""
    with trio.fail_after(timeout):
        hello = await conn.recv_exact(len(_MAGIC) + _CHALLENGE_BYTES)
        if hello[: len(_MAGIC)] != _MAGIC:
            raise AuthenticationError(f"{conn.peer} does not speak this protocol")
        ours = secrets.token_bytes(_CHALLENGE_BYTES)
        await conn.send_all(_MAGIC + _digest(secret, b"client", hello[len(_MAGIC) :]) + ours)
        try:
            answer = await conn.recv_exact(2 + _DIGEST_BYTES)
        except ConnectionClosed:
            raise AuthenticationError(f"{conn.peer} refused the connection (wrong secret?)") from None
        if answer[:2] != _OK:
            raise AuthenticationError(f"{conn.peer} refused the connection: wrong secret")
        if not hmac.compare_digest(answer[2:], _digest(secret, b"server", ours)):
            raise AuthenticationError(f"{conn.peer} could not prove the cluster secret")
