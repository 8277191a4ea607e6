"""The jail's layers by name, and the two settings that name them.

Kept apart from ``workers.isolation.jail`` (which sets the layers up) so that the
settings can be checked in any process, the web's included, without loading
the jail. See docs/security.md, "Jail layers, and what is refused when one is
missing".
"""

from __future__ import annotations

# Every layer a child may get, and what it stops. Order: the order they are set up.
LAYERS = {
    "pids_cgroup": "a fork bomb (a pids cgroup caps the job's tasks; uid 0 ignores RLIMIT_NPROC)",
    "namespaces": "connections (own network namespace), seeing or signalling other processes, host mounts",
    "tmpfs": "writes outside a private, size-capped, noexec temp dir",
    "unix_sockets": "connecting to the host's pathname UNIX sockets (databases, D-Bus, Docker, /dev/log)",
    "proc": "reading other processes through /proc (a fresh /proc of the child's own PID namespace)",
    "rlimits": "unbounded memory, CPU time, open files, file size, core dumps",
    "landlock": "reading or writing files outside the allowlist (secrets, NDIF_HOME, other users' files)",
    "landlock_net": "TCP bind and connect, as a second wall behind the network namespace (Landlock ABI 4)",
    "landlock_scope": "signals to, and abstract UNIX sockets of, processes outside the jail (Landlock ABI 6)",
    "drop_root": "using root: the child becomes nobody, or uid 0 with no capability",
    "no_new_privs": "regaining privileges through setuid binaries or file capabilities",
    "seccomp": "the kernel's riskiest system calls (io_uring, ptrace, bpf, mount, unshare, keyctl...)",
}
# Layers that a host may lack (an old kernel, no cgroup, no libseccomp) and an
# operator may therefore waive. The others are the jail's core: without them
# no untrusted code runs, whatever the settings say.
WAIVABLE = ("pids_cgroup", "unix_sockets", "proc", "landlock", "landlock_net", "landlock_scope", "seccomp")


def parse_require(text: str) -> tuple:
    """``NDIF_JAIL_REQUIRE`` to the layers that may be absent.

    ``all`` (the default) requires every layer; ``all,-seccomp,-pids_cgroup``
    requires all but the named ones. Only subtraction from ``all``: a layer
    added later is required until an operator waives it by name."""
    parts = [p.strip().lower() for p in (text or "all").split(",") if p.strip()]
    if not parts or parts[0] != "all":
        raise ValueError(f"NDIF_JAIL_REQUIRE must be 'all' or 'all,-layer,...', got {text!r}")
    waived = []
    for part in parts[1:]:
        if not part.startswith("-"):
            raise ValueError(f"NDIF_JAIL_REQUIRE: after 'all' name only layers that may be absent, "
                             f"as -layer, got {part!r}")
        _known(part[1:], "NDIF_JAIL_REQUIRE", part[1:], "waived")
        waived.append(part[1:])
    return tuple(waived)


def parse_disable(text: str) -> tuple:
    """``NDIF_JAIL_DISABLE``: layers a child should not even try (a comma list)."""
    names = tuple(p.strip().lower() for p in (text or "").split(",") if p.strip())
    for name in names:
        _known(name, "NDIF_JAIL_DISABLE", name, "disabled")
    return names


def _known(name: str, setting: str, raw: str, verb: str) -> None:
    if name not in LAYERS:
        raise ValueError(f"{setting}: unknown jail layer {raw!r} (layers: {', '.join(LAYERS)})")
    if name not in WAIVABLE:
        raise ValueError(f"{setting}: the {name} layer cannot be {verb} (it is the jail's core; these can: {', '.join(WAIVABLE)})")
