"""System calls a body must not make: the kernel keyrings, which no namespace here separates.

Why. Body UIDs are leased again, to other tenants too. The kernel's per-UID
user keyring (and a session keyring left behind) is not namespaced: it
outlives every process of the UID and is never cleared between leases, so a
secret one tenant's body put there (`add_key`) is read by the next tenant's
body that gets the UID (`keyctl read`). A body has no use for keyrings, so
it is refused them, as Docker's and systemd's default filters refuse them:
a seccomp-BPF filter makes `add_key`, `keyctl` and `request_key` fail with
EPERM and allows everything else. The filter also kills the process on a
system call of another ABI (32-bit `int 0x80`, x32 on x86_64), whose numbers
the filter does not check.

Installed in the body's process after `no_new_privs` (dask_gpu.isolation.identity.drop_to), before any byte a
flow sent is touched; it holds for the process and everything it starts, and cannot be removed. The program is
written by hand (struct sock_filter, as <linux/filter.h> and <linux/seccomp.h> define them) so that no
library is needed on the worker.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

from dask_gpu.isolation._errors import lazy_errors

__getattr__ = lazy_errors(__name__, {
    "SyscallFilterError": "The seccomp filter a body runs under could not be installed (an unknown architecture, or "
                          "the kernel refused it)."})

# <linux/audit.h>: the `arch` field of struct seccomp_data, and each architecture's keyring syscall numbers.
AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64 = 0xC000003E, 0xC00000B7
KEYRING_SYSCALLS = {  # arch -> (add_key, request_key, keyctl)
    AUDIT_ARCH_X86_64: (248, 249, 250),
    AUDIT_ARCH_AARCH64: (217, 218, 219),
}
MACHINES = {"x86_64": AUDIT_ARCH_X86_64, "amd64": AUDIT_ARCH_X86_64, "aarch64": AUDIT_ARCH_AARCH64,
            "arm64": AUDIT_ARCH_AARCH64}
X32_SYSCALL_BIT = 0x40000000

# <linux/filter.h> and <linux/seccomp.h>.
BPF_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
BPF_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
OFFSET_NR, OFFSET_ARCH = 0, 4  # struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; ... }
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter { __u16 code; __u8 jt; __u8 jf; __u32 k; }


def keyring_filter(arch: int | None = None) -> bytes:
    """The BPF program (struct sock_filter[]) `deny_keyrings` installs, for `arch` (this machine's by default)."""
    arch = this_arch() if arch is None else arch
    if arch not in KEYRING_SYSCALLS:
        raise __getattr__("SyscallFilterError")(
            f"no keyring filter for audit arch {arch:#x}. Fix: run workers on x86_64 or aarch64, or add this "
            "architecture's add_key/request_key/keyctl numbers to dask_gpu.isolation.syscalls.KEYRING_SYSCALLS")
    # (code, k, jump-if-true target, jump-if-false target); targets are resolved to relative jumps below.
    body: list[tuple[int, int, str | None, str | None]] = [
        (BPF_LD_W_ABS, OFFSET_ARCH, None, None),
        (BPF_JEQ_K, arch, None, "kill"),  # another ABI (i386 through int 0x80, ...): numbers this filter never checks
        (BPF_LD_W_ABS, OFFSET_NR, None, None),
    ]
    if arch == AUDIT_ARCH_X86_64:
        body.append((BPF_JGE_K, X32_SYSCALL_BIT, "kill", None))  # x32 calls share the x86_64 arch value
    body += [(BPF_JEQ_K, nr, "deny", None) for nr in KEYRING_SYSCALLS[arch]]
    labels = {"allow": len(body), "deny": len(body) + 1, "kill": len(body) + 2}
    program = [_insn(code, k, jt=labels[t] - i - 1 if t else 0, jf=labels[f] - i - 1 if f else 0)
               for i, (code, k, t, f) in enumerate(body)]
    program += [_insn(BPF_RET_K, SECCOMP_RET_ALLOW), _insn(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM),
                _insn(BPF_RET_K, SECCOMP_RET_KILL_PROCESS)]
    return b"".join(program)


def this_arch() -> int:
    machine = platform.machine().lower()
    if machine not in MACHINES:
        raise __getattr__("SyscallFilterError")(
            f"no seccomp filter is known for machine {machine!r}. Fix: run workers on x86_64 or aarch64")
    return MACHINES[machine]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]  # struct sock_fprog


def deny_keyrings() -> None:
    """From now on this process and its children get EPERM from add_key, keyctl and request_key.

    Call it with no_new_privs set (or CAP_SYS_ADMIN), before the process starts threads: prctl filters the calling
    thread and what it forks, not threads already running."""
    program = keyring_filter()
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise __getattr__("SyscallFilterError")(
            f"prctl(PR_SET_SECCOMP) refused the keyring filter: {errno.errorcode.get(err, err)} "
            f"({os.strerror(err)}). "
            "Fix: set no_new_privs first (dask_gpu.isolation.identity.no_new_privs), on a kernel built with "
            "CONFIG_SECCOMP_FILTER")
