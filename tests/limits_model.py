"""AI tasks that push against a body's limits: memory, processes. Their module travels to the workers as source."""

from __future__ import annotations

import os
import time
from pathlib import Path

from aisched_prefect import ai_task


@ai_task(gpus=0.25, kind="training", est_seconds=60)
def hog(megabytes: int) -> int:
    """Allocates and touches `megabytes` of memory."""
    block = bytearray(megabytes * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    return len(block)


@ai_task(gpus=0.25, kind="training", est_seconds=60)
def fork_bomb(pids_file: str) -> int:
    """Forks sleepers until the kernel refuses; notes each child's pid on a shared path."""
    children = []
    try:
        while True:
            pid = os.fork()
            if pid == 0:
                while True:
                    time.sleep(60)
            children.append(pid)
            Path(pids_file).write_text(" ".join(map(str, children)))
    finally:
        Path(pids_file).write_text(" ".join(map(str, children)))


@ai_task(gpus=0.25, kind="training", est_seconds=60)
def steady(x: int) -> int:
    return x * 2


@ai_task(gpus=0.25, kind="training", est_seconds=60)
def flood(megabytes: int) -> int:
    """As a hostile body would: finds the socket its result goes back on and streams `megabytes` down it, announced as
    one message, a MiB at a time (its own memory stays small: only the worker would hold it all)."""
    import gc
    import socket
    import struct

    chunk = b"x" * 2**20
    for sock in [o for o in gc.get_objects() if isinstance(o, socket.socket)]:
        if sock.family == socket.AF_UNIX and sock.fileno() >= 0:
            sock.sendall(struct.pack(">Q", megabytes * 2**20))
            for _ in range(megabytes):
                sock.sendall(chunk)
    return 0


@ai_task(gpus=0.25, kind="training", est_seconds=60)
def unsealed_handover(megabytes: int) -> int:
    """As a hostile body would: hands its worker a memory file it did not seal, announced as its result (it could then
    change the bytes after the worker checked them, or shrink the file under the worker's mapping)."""
    import gc
    import json
    import socket
    import struct

    fd = os.memfd_create("result", os.MFD_ALLOW_SEALING)
    os.write(fd, b"x" * (megabytes * 2**20))
    meta = json.dumps({"ok": True, "sealed": True, "error_text": "", "error_type": "", "logs": [], "reports": []})
    for sock in [o for o in gc.get_objects() if isinstance(o, socket.socket)]:
        if sock.family == socket.AF_UNIX and sock.fileno() >= 0:
            sock.sendall(struct.pack(">Q", len(meta)) + meta.encode())
            socket.send_fds(sock, [struct.pack(">Q", megabytes * 2**20)], [fd])
    time.sleep(30)  # what it would do meanwhile: the worker has ended it by then
    return 0


@ai_task(gpus=0.25, kind="training", est_seconds=60)
def large(megabytes: int) -> bytes:
    return b"r" * (megabytes * 2**20)
