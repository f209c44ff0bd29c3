"""Length-prefixed messages over a socket: how a worker, a zygote and a body talk (no pickling on this layer).

A large message (a body's result) is not streamed: the sender writes it into a memory file of its own, seals it
(nothing can change its bytes or its size after) and hands the descriptor over; the receiver checks the seals and
the size and maps it read-only. Its bytes are written once, by the sender, and never copied through the socket.

>>> import socket
>>> a, b = socket.socketpair()
>>> send_msg(a, b"hello"); recv_msg(b)
b'hello'
>>> fd = memory_file(); _ = os.write(fd, b"x" * 10); send_sealed(a, fd, 10); os.close(fd)
>>> bytes(recv_sealed(b, limit=100))
b'xxxxxxxxxx'
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import stat
import struct

from dask_gpu.errors import MessageRefused, MessageTooLarge

_LEN = struct.Struct(">Q")


JOIN_BELOW = 1 << 16  # a message this small goes out with its length in one send; a larger one is not copied


def send_msg(sock: socket.socket, data: bytes) -> None:
    """The length, then the bytes as they are (a 100 MB result is not copied to put 8 bytes in front of it)."""
    if len(data) < JOIN_BELOW:
        sock.sendall(_LEN.pack(len(data)) + data)
    else:
        sock.sendall(_LEN.pack(len(data)))
        sock.sendall(data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes, read straight into the bytes returned where the socket blocks (MSG_WAITALL: no second
    copy of a large result); what a timeout, a signal or a non-blocking socket cut short is read on into a buffer."""
    first = sock.recv(n, socket.MSG_WAITALL) if n else b""
    if len(first) == n:
        return first
    if not first:
        raise EOFError("peer closed the connection")
    view = bytearray(n)
    view[:len(first)] = first
    mem, got = memoryview(view), len(first)
    while got < n:
        k = sock.recv_into(mem[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k
    return bytes(view)


def recv_msg(sock: socket.socket, limit: int | None = None) -> bytes:
    """One message; one announced longer than `limit` is refused before a byte of it is read or held."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    _within(n, limit)
    return recv_exact(sock, n)


def _within(n: int, limit: int | None) -> None:
    """A message's announced length against what its peer may send: MessageTooLarge before any of it is read."""
    if limit is not None and n > limit:
        raise MessageTooLarge(f"the peer announced {n} bytes, more than the {limit} it may send")


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    """Whether `sock` has bytes (or its end) within `seconds`; poll(), not select(): a busy worker's descriptors pass
    select()'s 1,024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, int(seconds * 1000))))


HANDOFF_FROM = 1 << 20  # a body's result at least this large is handed over in a sealed memory file
_SEALED = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def memory_file() -> int:
    """A fresh anonymous memory file (memfd) that can be sealed: where a sender writes a large message."""
    return os.memfd_create("dask-gpu-message", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def send_sealed(sock: socket.socket, fd: int, size: int) -> None:
    """Seal memory file `fd` (its `size` bytes can no longer change, by any descriptor or mapping) and hand it over
    with its length; the caller still closes its own descriptor."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALED)
    socket.send_fds(sock, [_LEN.pack(size)], [fd])


def recv_sealed(sock: socket.socket, limit: int | None = None) -> mmap.mmap:
    """A message handed over by `send_sealed`, mapped read-only. Refused (MessageRefused; every descriptor that came
    closed) unless exactly one came, a memory file sealed against writing, growing and shrinking, of the length
    announced; refused (MessageTooLarge) past `limit`. The seals are what make it safe to map: the sender keeps no
    way to change what was checked, nor to shrink the file under the mapping (which would fault the reader)."""
    msg, fds, flags, _ = socket.recv_fds(sock, _LEN.size, 4)
    try:
        if not msg:
            raise EOFError("peer closed the connection")
        if len(msg) < _LEN.size:
            msg += recv_exact(sock, _LEN.size - len(msg))
        (n,) = _LEN.unpack(msg)
        if flags & socket.MSG_CTRUNC or len(fds) != 1:
            raise MessageRefused(f"the peer announced a {n}-byte memory file but handed over {len(fds)} descriptors")
        _within(n, limit)
        try:
            seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
        except OSError:
            raise MessageRefused("the peer handed over a descriptor that is not a memory file") from None
        info = os.fstat(fds[0])
        if seals & _SEALED != _SEALED or not stat.S_ISREG(info.st_mode) or info.st_size != n or n == 0:
            raise MessageRefused(f"the peer handed over a memory file that is not sealed, or not of the {n} bytes it "
                                 f"announced ({info.st_size} bytes, seals {seals:#x})")
        return mmap.mmap(fds[0], n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        for fd in fds:
            os.close(fd)
