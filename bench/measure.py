"""Small measuring helpers shared by the bench scripts: percentiles, exact
comparison of results, process memory, the git commit, tables."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty sample."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stats(samples_ms: list[float]) -> dict:
    if not samples_ms:
        return {"n": 0}
    return {
        "n": len(samples_ms),
        "p50_ms": round(percentile(samples_ms, 0.5), 3),
        "p95_ms": round(percentile(samples_ms, 0.95), 3),
        "min_ms": round(min(samples_ms), 3),
        "mean_ms": round(sum(samples_ms) / len(samples_ms), 3),
        "samples_ms": [round(s, 3) for s in samples_ms],
    }


def difference(a: Any, b: Any, path: str = "result") -> Optional[str]:
    """The first difference between two results (tensors by dtype, shape and
    ``torch.equal``; dicts, lists and tuples recursively), or None."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a.detach().cpu(), b.detach().cpu()):
            return f"{path}: values differ"
        return None
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            found = difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def result_bytes(value: Any) -> int:
    """Bytes of tensor data in a result (recursively)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(result_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(result_bytes(v) for v in value)
    return 0


# -- processes -----------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (alive now)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        return [pid] + [child.pid for child in proc.children(recursive=True)]
    except ImportError:
        pids, todo = [], [pid]
        while todo:
            current = todo.pop()
            pids.append(current)
            for task in Path(f"/proc/{current}/task").glob("*/children"):
                todo.extend(int(c) for c in task.read_text().split())
        return pids
    except Exception:  # noqa: BLE001 - gone
        return []


def proc_status_kib(pid: int, field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/<pid>/status, in KiB (0 if gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def reset_peak_rss(pids: Iterable[int]) -> bool:
    """Reset each process's VmHWM to its current RSS (clear_refs 5); whether all worked."""
    ok = True
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            ok = False
    return ok


# -- git -------------------------------------------------------------------------


def git_commit() -> str:
    """``git rev-parse --short HEAD``, plus ``+dirty`` when tracked files changed."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


# -- printing --------------------------------------------------------------------


def fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if unit == "x":
        return f"{value:.2f}x"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render_table(title: str, columns: list[str], rows: list[tuple[str, list[str]]]) -> str:
    label_width = max([len(label) for label, _ in rows] + [8])
    widths = [max(len(col), *(len(cells[i]) for _, cells in rows if i < len(cells))) for i, col in enumerate(columns)]
    lines = [title, " " * label_width + "".join(f"  {col:>{w}}" for col, w in zip(columns, widths))]
    for label, cells in rows:
        lines.append(f"{label:<{label_width}}" + "".join(f"  {cell:>{w}}" for cell, w in zip(cells, widths)))
    return "\n".join(lines)
