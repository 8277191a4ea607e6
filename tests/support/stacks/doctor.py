"""Reading ``ndif-celery doctor``'s report: one line a check (status, name,
detail in fixed columns), a ``fix:`` line under a check that has one."""

from __future__ import annotations


def checks(stdout: str) -> dict[str, tuple[str, str, str]]:
    """check name -> (status, detail, fix) from doctor's columns: status, name, detail."""
    found: dict[str, tuple[str, str, str]] = {}
    last = None
    for line in stdout.splitlines():
        if line[:5].strip() in ("OK", "WARN", "FAIL", "SKIP"):
            last = line[6:20].strip()
            found[last] = (line[:5].strip(), line[21:], "")
        elif line.strip().startswith("fix: ") and last:
            status, detail, _ = found[last]
            found[last] = (status, detail, line.strip()[len("fix: "):])
    return found
