"""An identity of a body's own: an unprivileged UID/GID from the operator's range, never the worker's.

As Slurm runs a job under its own UID and systemd's DynamicUser hands a
service a UID from a pool: the worker leases each body a UID from
`body_uids` (least recently used first, so a UID comes back only after the
whole range has turned over), and the body's process drops to it (no
supplementary groups, GID = UID) before it touches a byte a flow sent.
Dropping every UID from 0 clears the process's capabilities; no_new_privs
keeps an exec (a setuid binary) from gaining any back.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque

PR_SET_NO_NEW_PRIVS = 38


class UidPool:
    """UIDs leased to running bodies, from `first` to `last` inclusive, exclusive across this host's workers.

    Several workers on one host (`dask worker --nworkers 4`, or one per GPU) are given the same range; a UID
    leased by one must not be another's body's at the same time. Each lease takes an exclusive `flock` on
    `locks/<uid>` (a root-owned folder no body can open): a UID another worker holds is skipped, and a worker
    that dies lets go of its UIDs with its file descriptors.
    """

    def __init__(self, first: int, last: int, locks: str | None = None) -> None:
        self._free = deque(range(first, last + 1))
        self._lock = threading.Lock()
        self._locks = locks
        self._held: dict[int, int] = {}  # uid -> the descriptor of its lock file
        if locks is not None:
            os.makedirs(locks, mode=0o700, exist_ok=True)
            os.chmod(locks, 0o700)

    def lease(self) -> int:
        from dask_gpu.isolation import IsolationError

        with self._lock:
            for _ in range(len(self._free)):
                uid = self._free.popleft()
                if self._take(uid):
                    return uid
                self._free.append(uid)  # another worker of this host holds it: try it again later
            raise IsolationError("every UID of --body-uids is held by a running body of this host's workers. Fix: "
                                 "give the workers a wider range (dask-gpu-worker --body-uids FIRST-LAST)")

    def _take(self, uid: int) -> bool:
        if self._locks is None:
            return True
        import fcntl

        fd = os.open(os.path.join(self._locks, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held[uid] = fd
        return True

    def release(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid, None)
            if fd is not None:
                os.close(fd)  # the lock goes with it
            if uid not in self._free:
                self._free.append(uid)


def no_new_privs() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def drop_to(uid: int, gid: int, groups: list[int] | None = None) -> None:
    """Become `uid`/`gid` for good (real, effective and saved), with `groups` as its only supplementary groups (its
    tenant's group: the team's shared storage), no capabilities left; raise if any remain."""
    os.setgroups(list(groups or []))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    no_new_privs()
    with open("/proc/self/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    if int(status.get("CapEff", "0"), 16) or int(status.get("CapPrm", "0"), 16):
        raise PermissionError(f"the body's process still holds capabilities after dropping to UID {uid}")
    if os.getuid() != uid or os.geteuid() != uid:
        raise PermissionError(f"the body's process is not UID {uid} after dropping to it")
