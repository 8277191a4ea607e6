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
    if not client_versions.RELEASE.fullmatch(version):
        raise RuntimeFailure(f"a runtime is one exact nnsight release such as 0.7.0, got {version[:40]!r}")
    return version


def check_name(name: str) -> str:
    """A runtime's name as ``add`` made it: a release, with ``+pyX.Y`` on another Python minor."""
    name = (name or "").strip()
    if not client_versions.RUNTIME_NAME.fullmatch(name):
        raise RuntimeFailure(f"a runtime is named by an nnsight release such as 0.7.0 (0.5.15+py3.12 on another "
                             f"Python), got {name[:40]!r}")
    return name


def folder(home: Path, name: str) -> Path:
    return Path(home) / FOLDER / f"nnsight-{check_name(name)}"


def find(home: Path, version: str) -> Runtime:
    """The recorded runtime of ``version``; a clear error when there is none or it is broken."""
    path = folder(home, version)
    if not path.is_dir():
        release, _, minor = version.partition(client_versions.MINOR_LABEL)
        how = f"{release} --python /path/to/python{minor}" if minor else release
        raise RuntimeFailure(f"no nnsight {version} runtime on this host; add it with `ndif-celery runtime add {how}`")
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
        if client_versions.RUNTIME_NAME.fullmatch(version):
            runtimes.append(_read(path, version))
    return runtimes


def _read(path: Path, version: str) -> Runtime:
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return Runtime(version, path)
    return Runtime(version, path, record.get("python"), record.get("packages"), record.get("created_at"))


def add(home: Path, version: str, index_args: tuple = (), log=print, python: Optional[str] = None) -> Runtime:
    """Make the runtime of ``version`` (see the module's doc); an existing good one is kept.

    ``python``: another interpreter to build it on. On the farm's own Python
    minor it changes nothing. On another minor the runtime is named for it
    (``0.5.15+py3.12``) and holds its own copy of the farm (no ``.pth``: the
    farm's compiled packages are not that Python's); only a 0.5 client needs one."""
    version = check_version(version)
    try:
        client_versions.check_served_at_all(version)
    except client_versions.VersionRefused as exc:
        raise RuntimeFailure(str(exc)) from None
    minor = _minor_of(python) if python else _own_minor()
    name = version if minor == _own_minor() else client_versions.runtime_name(version, minor)
    if name != version and not client_versions.sends_bytecode(version):
        raise RuntimeFailure(f"nnsight {version} clients send source, which runs on any Python: add it on the "
                             f"farm's own Python ({_own_minor()}), without --python")
    if version == main_version():
        raise RuntimeFailure(f"nnsight {version} is the farm's own: every worker runs it without a runtime")
    path = folder(home, name)
    if path.is_dir():
        existing = _read(path, name)
        if existing.ok:
            return existing
        shutil.rmtree(path)  # a broken add: start again
    try:
        if name == version:
            packages = build_environment(path, [f"nnsight=={version}"], index_args, log)
        else:
            packages = build_environment(path, [f"nnsight=={version}", _farm_requirement()], index_args, log,
                                         python=python)
        if packages.get("nnsight") != version:
            raise RuntimeFailure(f"the environment imports nnsight {packages.get('nnsight')}, not {version}")
        record = {"version": version, "python": packages.pop("python"), "packages": packages,
                  "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        (path / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # nothing half-made stays to be mistaken for a runtime
        raise
    return _read(path, name)


def _own_minor() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _minor_of(python: str) -> str:
    """The major.minor of the interpreter at ``python``, asked of it."""
    try:
        out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeFailure(f"cannot run the interpreter {python!r}: {exc}") from None
    if out.returncode != 0 or not re.fullmatch(r"\d+\.\d+", out.stdout.strip()):
        raise RuntimeFailure(f"{python!r} is not a Python interpreter: {_last_line(out.stderr or out.stdout)}")
    return out.stdout.strip()


def _farm_requirement() -> str:
    """This package as pip installs it elsewhere: the source tree it runs from, else its release."""
    tree = Path(__file__).resolve().parents[2]
    return str(tree) if (tree / "setup.cfg").is_file() else f"ndif-celery=={metadata.version('ndif-celery')}"


def build_environment(path: Path, requirements: list, index_args: tuple = (), log=print,
                      drop: tuple = (), python: Optional[str] = None) -> dict:
    """A virtual environment at ``path`` over the farm's packages (see the
    module's doc) with ``requirements`` installed; what its interpreter
    imports. ``drop``: packages pip brought along that break beside the
    farm's torch, uninstalled before the check (the index's torchvision).
    ``python``: another interpreter; its environment sees none of the farm's
    packages and installs its own, held to the same torch and transformers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"creating {path}" + (f" on {python}" if python else ""))
    _run([python or sys.executable, "-m", "venv", str(path)], "create the environment")
    if not python:
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
