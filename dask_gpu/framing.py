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

_LEN = struct.Struct(">Q")


def send_msg(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    view = bytearray(n)
    mem, got = memoryview(view), 0
    while got < n:
        k = sock.recv_into(mem[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k
    return bytes(view)


def recv_msg(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return recv_exact(sock, n)


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    ready, _, _ = select.select([sock], [], [], seconds)
    return bool(ready)
