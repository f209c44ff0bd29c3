"""Length-prefixed messages over a socket: how a worker, a zygote and a body talk (no pickling on this layer).

>>> import socket
>>> a, b = socket.socketpair()
>>> send_msg(a, b"hello"); recv_msg(b)
b'hello'
"""

from __future__ import annotations

import select
import socket
import struct

from dask_gpu.errors import MessageTooLarge

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
    if limit is not None and n > limit:
        raise MessageTooLarge(f"the peer announced {n} bytes, more than the {limit} it may send")
    return recv_exact(sock, n)


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    ready, _, _ = select.select([sock], [], [], seconds)
    return bool(ready)
