"""Jail layer ``seccomp``: a system-call filter, loaded last.

Why a module of its own: the filter (``libseccomp`` through ``pyseccomp``)
refuses what no experiment needs (io_uring, ptrace, bpf, mount, unshare,
keyctl...) and ``socket()`` of every family not in :data:`SOCKET_FAMILIES_ALLOWED`
(none: a child talks to its worker over the pipes it was born with); its binding must be found before /tmp
is masked (``load_seccomp_binding``), and the filter loaded after every
other layer, since nothing after it may need a refused call.
"""

from __future__ import annotations

import errno

from .kernel import CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, CLONE_NEWUTS, JailError

# System calls no experiment needs, refused with EPERM: kernel attack surface
# (io_uring, bpf, perf, userfaultfd, keyrings), other processes' memory
# (ptrace, process_vm_*), anything that changes mounts, namespaces or the
# machine. Names this architecture lacks are skipped.
SECCOMP_DENIED = (
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "name_to_handle_at", "open_by_handle_at", "lookup_dcookie", "fanotify_init",
    "syslog", "vhangup", "iopl", "ioperm", "modify_ldt", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "vmsplice",
)
_CLONE_NAMESPACES = (CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
                     0x02000000)  # ... and CLONE_NEWCGROUP
# personality() bits that weaken the next exec (no ASLR, executable data, page zero...).
_PERSONALITY_RISKY = (0x0020000, 0x0040000, 0x0100000, 0x0200000, 0x0400000, 0x0800000, 0x8000000)
# The socket families a child may create: none. Every family is refused
# (UNIX, INET, INET6, NETLINK, PACKET, VSOCK, ALG, ...), so a kernel's bug in
# one it never needed is out of reach, whatever the namespaces and Landlock
# leave. A family added here must say why a job needs it.
SOCKET_FAMILIES_ALLOWED: tuple = ()
AF_MAX = 46  # one past the highest family Linux defines (linux/socket.h); every higher one is refused too


_seccomp = None


def load_seccomp_binding():
    """Import ``pyseccomp`` (it finds libseccomp.so with ``ldconfig``, which
    needs /tmp: so before the mounts). Raises JailError where it is missing."""
    global _seccomp
    if _seccomp is None:
        try:
            import pyseccomp
        except (ImportError, RuntimeError, OSError) as error:  # RuntimeError: no libseccomp.so on the host
            raise JailError(f"libseccomp is not available ({error})") from None
        _seccomp = pyseccomp
    return _seccomp


def seccomp_filter() -> None:
    """Load the filter on every thread of this process (TSYNC). Raises
    JailError where libseccomp (or its binding) is missing."""
    sc = load_seccomp_binding()
    eperm = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    for name in SECCOMP_DENIED:
        try:
            rules.add_rule(eperm, name)
        except OSError:  # no such call on this architecture
            continue
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # libc falls back to clone(), whose flags we can read
    for flag in _CLONE_NAMESPACES:
        rules.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for bit in _PERSONALITY_RISKY:  # bit 31 set: the 0xffffffff query, allowed
        rules.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, 0x80000000 | bit, bit))
    # socket(): only the allowed families (UNIX ones included: the host's sockets
    # stay out of reach even if one was bound after the mount masks were made).
    if not SOCKET_FAMILIES_ALLOWED:
        rules.add_rule(eperm, "socket")
    else:
        for family in range(AF_MAX):
            if family not in SOCKET_FAMILIES_ALLOWED:
                rules.add_rule(eperm, "socket", sc.Arg(0, sc.EQ, family))
        rules.add_rule(eperm, "socket", sc.Arg(0, sc.GE, AF_MAX))
    rules.set_attr(sc.Attr.CTL_TSYNC, 1)
    try:
        rules.load()
    except OSError as error:
        raise JailError(f"loading the seccomp filter failed: {error}") from None
