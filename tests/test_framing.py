"""Length-prefixed messages between a worker and its bodies (dask_gpu.framing), as units over real socket pairs."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from dask_gpu.errors import MessageRefused, MessageTooLarge
from dask_gpu.framing import JOIN_BELOW, memory_file, recv_msg, recv_sealed, send_msg, send_sealed


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


# -- a large message handed over as a sealed memory file ----------------------------------------------------------

def _memfd(data: bytes, seal: bool = True) -> int:
    fd = memory_file()
    os.write(fd, data)
    if seal:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE)
    return fd


def _holding(fds: list[int]) -> int:
    """How many of this process's descriptors point where `fds` do (by /proc's links: other threads' descriptors, of
    other tests in the same worker, do not count)."""
    targets = {os.readlink(f"/proc/self/fd/{fd}") for fd in fds}
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") in targets
        except OSError:  # closed meanwhile
            pass
    return count


def test_a_sealed_memory_file_arrives_mapped_and_its_sender_can_no_longer_change_it():
    a, b = socket.socketpair()
    data = os.urandom(3 * 2**20)
    fd = memory_file()
    os.write(fd, data)
    send_sealed(a, fd, len(data))
    got = recv_sealed(b, limit=len(data))
    assert bytes(got) == data
    with pytest.raises(PermissionError):  # sealed: the sender's own descriptor writes nothing any more
        os.pwrite(fd, b"changed", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 1)  # nor shrinks it under the reader's mapping
    assert bytes(got[:7]) == data[:7]
    os.close(fd)
    a.close(), b.close()


def _refused(send, fds: list[int], limit: int | None = None, error: type[Exception] = MessageRefused) -> None:
    a, b = socket.socketpair()
    before = _holding(fds) if fds else 0
    try:
        send(a)
        with pytest.raises(error):
            recv_sealed(b, limit=limit)
        assert (_holding(fds) if fds else 0) == before, "a refused descriptor was left open"
    finally:
        a.close(), b.close()


def test_a_memory_file_that_is_not_sealed_is_refused():
    fd = _memfd(b"x" * 100, seal=False)
    _refused(lambda a: socket.send_fds(a, [struct.pack(">Q", 100)], [fd]), [fd])
    os.close(fd)


def test_a_descriptor_that_is_not_a_memory_file_is_refused():
    r, w = os.pipe()  # a pipe the reader could block on, or a file it could read past
    _refused(lambda a: socket.send_fds(a, [struct.pack(">Q", 100)], [r]), [r])
    os.close(r), os.close(w)


def test_a_sealed_memory_file_of_another_size_than_announced_is_refused():
    fd = _memfd(b"x" * 100)
    _refused(lambda a: socket.send_fds(a, [struct.pack(">Q", 1000)], [fd]), [fd])
    os.close(fd)


def test_several_descriptors_or_none_are_refused():
    one, two = _memfd(b"x" * 100), _memfd(b"y" * 100)
    _refused(lambda a: socket.send_fds(a, [struct.pack(">Q", 100)], [one, two]), [one, two])
    _refused(lambda a: a.sendall(struct.pack(">Q", 100) + b"x" * 100), [])
    os.close(one), os.close(two)


def test_a_sealed_memory_file_past_the_limit_is_refused_unmapped():
    fd = _memfd(b"x" * 4096)
    _refused(lambda a: socket.send_fds(a, [struct.pack(">Q", 4096)], [fd]), [fd], limit=4095, error=MessageTooLarge)
    os.close(fd)


def test_waiting_for_bytes_works_on_a_descriptor_past_1024():
    """select() refuses a descriptor of 1,024 or more; a busy worker's body sockets get there."""
    import os
    import socket

    from dask_gpu.framing import wait_readable

    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1500)
    far = socket.socket(fileno=high)
    try:
        assert not wait_readable(far, 0.01)
        b.sendall(b"x")
        assert wait_readable(far, 5)
    finally:
        far.close()
        a.close()
        b.close()
