"""Length-prefixed messages between a worker and its bodies (dask_gpu.framing), as units over real socket pairs."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from dask_gpu.errors import MessageTooLarge
from dask_gpu.framing import JOIN_BELOW, recv_msg, send_msg


@pytest.mark.parametrize("size", [0, 1, JOIN_BELOW - 1, JOIN_BELOW, 8 * 2**20 + 3])
@pytest.mark.parametrize("timeout", [None, 5.0], ids=["blocking", "timeout"])
def test_a_message_arrives_whole_as_bytes_small_or_large_on_a_blocking_or_timed_socket(size, timeout):
    a, b = socket.socketpair()
    b.settimeout(timeout)  # a socket with a timeout reads what has come so far: the rest is read on
    data = os.urandom(size)
    sender = threading.Thread(target=lambda: (send_msg(a, data), send_msg(a, b"next")))
    try:
        sender.start()
        got = recv_msg(b)
        assert type(got) is bytes and got == data
        assert recv_msg(b) == b"next"  # nothing of the first message was left behind or read past
    finally:
        sender.join()
        a.close()
        b.close()


def test_a_message_cut_short_by_its_peer_is_an_eof_not_a_short_message():
    a, b = socket.socketpair()
    a.sendall(struct.pack(">Q", 1000) + b"x" * 10)
    a.close()
    with pytest.raises(EOFError):
        recv_msg(b)
    b.close()


def test_a_message_announced_past_the_limit_is_refused_before_any_of_it_is_read():
    a, b = socket.socketpair()
    a.sendall(struct.pack(">Q", 2**40) + b"first bytes of a flood")
    with pytest.raises(MessageTooLarge, match="announced 1099511627776 bytes, more than the 1024 it may send"):
        recv_msg(b, limit=1024)
    assert b.recv(5) == b"first"  # nothing past the length was read
    a.close()
    b.close()
    c, d = socket.socketpair()
    send_msg(c, b"y" * 1024)
    assert recv_msg(d, limit=1024) == b"y" * 1024  # at the limit is allowed
    c.close()
    d.close()
