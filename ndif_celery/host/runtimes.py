"""Client runtimes: another nnsight for the workers that serve that client's version.

A payload only runs under the exact nnsight that made it (no pickle crosses a
minor version, and patches differ in meaning), so a farm that serves the 0.7.0
client needs a worker with nnsight 0.7.0. The farm's own nnsight (the one this
package is installed with) is the main runtime and needs nothing.

Another is a virtual environment under ``NDIF_HOME/runtimes/nnsight-<version>``:

- the farm's own packages (torch, transformers, Celery, this package) are seen
  through a ``.pth`` file, after the environment's own, so only what that
  nnsight needs beyond them is installed, and its nnsight shadows the farm's;
- the install holds the farm's torch and transformers as pip constraints: pip
  never swaps in another torch (a CUDA wheel least of all) or transformers line,
  so the runtime computes exactly as the farm does;
- it is checked by importing it with its own interpreter before it is recorded
  (``runtime.json``: the versions it runs with). A folder without that record
  is a failed or interrupted add, listed as broken.

Each host that runs a worker for a runtime needs it added there.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from ndif_celery.policy import client_versions

FOLDER = "runtimes"
RECORD = "runtime.json"
#: What the farm holds the runtime to: the same tensors, from the same wheels.
PINNED = ("torch", "transformers")
_VERSION = re.compile(r"^\d+\.\d+\.\d+(?:\.post\d+)?$")
INSTALL_TIMEOUT_S = 900


class RuntimeFailure(Exception):
    """A runtime that cannot be added, found or removed; the message says why."""


@dataclass(frozen=True)
class Runtime:
    version: str
    path: Path
    python: Optional[str] = None  # the interpreter's version, as recorded
    packages: Optional[dict] = None  # nnsight, torch, transformers, as imported at the check
    created_at: Optional[str] = None

    @property
    def interpreter(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def ok(self) -> bool:
        return self.packages is not None

    def row(self) -> dict:
        return {"version": self.version, "path": str(self.path), "ok": self.ok, "python": self.python,
                "packages": self.packages, "created_at": self.created_at, "main": False}


def main_version() -> str:
    """The farm's own nnsight: the runtime every worker has without an add."""
    return client_versions.MAIN


def check_version(version: str) -> str:
    """An exact release such as 0.7.0: runtimes are per exact version, never a range."""
    version = (version or "").strip()
    if not _VERSION.match(version):
        raise RuntimeFailure(f"a runtime is one exact nnsight release such as 0.7.0, got {version[:40]!r}")
    return version


def folder(home: Path, version: str) -> Path:
    return Path(home) / FOLDER / f"nnsight-{check_version(version)}"


def find(home: Path, version: str) -> Runtime:
    """The recorded runtime of ``version``; a clear error when there is none or it is broken."""
    path = folder(home, version)
    if not path.is_dir():
        raise RuntimeFailure(f"no nnsight {version} runtime on this host; add it with `ndif-celery runtime add {version}`")
    runtime = _read(path, version)
    if not runtime.ok:
        raise RuntimeFailure(f"the nnsight {version} runtime at {path} is broken (its add did not finish); "
                             f"remove it and add it again")
    return runtime


def listing(home: Path) -> list[Runtime]:
    """Every runtime folder on this host, by version."""
    root = Path(home) / FOLDER
    runtimes = []
    for path in sorted(root.glob("nnsight-*")) if root.is_dir() else []:
        version = path.name.removeprefix("nnsight-")
        if _VERSION.match(version):
            runtimes.append(_read(path, version))
    return runtimes


def _read(path: Path, version: str) -> Runtime:
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return Runtime(version, path)
    return Runtime(version, path, record.get("python"), record.get("packages"), record.get("created_at"))


def add(home: Path, version: str, index_args: tuple = (), log=print) -> Runtime:
    """Make the runtime of ``version`` (see the module's doc); an existing good one is kept."""
    version = check_version(version)
    try:
        client_versions.check_served_at_all(version)
    except client_versions.VersionRefused as exc:
        raise RuntimeFailure(str(exc)) from None
    if version == main_version():
        raise RuntimeFailure(f"nnsight {version} is the farm's own: every worker runs it without a runtime")
    path = folder(home, version)
    if path.is_dir():
        existing = _read(path, version)
        if existing.ok:
            return existing
        shutil.rmtree(path)  # a broken add: start again
    try:
        packages = build_environment(path, [f"nnsight=={version}"], index_args, log)
        if packages.get("nnsight") != version:
            raise RuntimeFailure(f"the environment imports nnsight {packages.get('nnsight')}, not {version}")
        record = {"version": version, "python": packages.pop("python"), "packages": packages,
                  "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        (path / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # nothing half-made stays to be mistaken for a runtime
        raise
    return _read(path, version)


def build_environment(path: Path, requirements: list, index_args: tuple = (), log=print,
                      drop: tuple = ()) -> dict:
    """A virtual environment at ``path`` over the farm's packages (see the
    module's doc) with ``requirements`` installed; what its interpreter
    imports. ``drop``: packages pip brought along that break beside the
    farm's torch, uninstalled before the check (the index's torchvision)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"creating {path}")
    _run([sys.executable, "-m", "venv", str(path)], "create the environment")
    site_packages = _site_packages(Path(path / "bin" / "python"))
    farm = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    # Executed at start-up: the farm's site folders (their own .pth files too), after this environment's.
    (site_packages / "_ndif_farm.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in farm) + "\n")
    constraints = path / "constraints.txt"
    constraints.write_text("".join(f"{name}=={metadata.version(name)}\n" for name in PINNED))
    log(f"installing {' '.join(requirements)} (holding {', '.join(f'{n} {metadata.version(n)}' for n in PINNED)})")
    _run([str(path / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
          "-c", str(constraints), *index_args, *requirements], f"install {' '.join(requirements)}",
         timeout=INSTALL_TIMEOUT_S)
    if drop:
        _run([str(path / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *drop], f"uninstall {' '.join(drop)}")
    packages = _imported(path / "bin" / "python")
    for name in PINNED:
        if packages.get(name) != metadata.version(name):
            raise RuntimeFailure(f"the environment imports {name} {packages.get(name)}, not the farm's "
                                 f"{metadata.version(name)}")
    return packages


def remove(home: Path, version: str) -> Path:
    path = folder(home, version)
    if not path.is_dir():
        raise RuntimeFailure(f"no nnsight {version} runtime on this host")
    shutil.rmtree(path)
    return path


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


_CHECK = """
import json, platform
import nnsight, torch, transformers
print(json.dumps({"python": platform.python_version(), "nnsight": nnsight.__version__,
                  "torch": torch.__version__, "transformers": transformers.__version__}))
"""


def _imported(python: Path) -> dict:
    """What the runtime's own interpreter imports: its nnsight, and the farm's torch and transformers."""
    out = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeFailure(f"the new environment does not import nnsight: {_last_line(out.stderr)}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(argv: list, what: str, timeout: float = 300) -> None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeFailure(f"could not {what}: no answer within {timeout:.0f} s") from None
    if out.returncode != 0:
        raise RuntimeFailure(f"could not {what}: {_last_line(out.stderr or out.stdout)}")


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else "(no output)"
