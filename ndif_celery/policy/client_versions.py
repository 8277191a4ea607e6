"""The client version gates: the runtimes served, ``NDIF_MIN_NNSIGHT_VERSION`` and ``NDIF_MIN_PYTHON_VERSION``.

The nnsight client stamps every ``POST /request`` with the headers
``nnsight-version`` (its installed version, or ``""`` when nnsight runs from a
source tree) and ``python-version`` (the whole ``sys.version``). With a minimum
set, an older or non-reporting client is refused with 400 and NDIF's own
messages; unset (or empty), that check is off. Python is compared on
major.minor only. ``/subscribe`` is not gated (NDIF does not gate it, and the
client sends no version headers there).

Torch-free: the web imports this.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Callable, Optional

from packaging.version import InvalidVersion, Version

from ndif_celery import socketio_wire, wire
from ndif_celery.errors import Refused

NNSIGHT_HEADER = "nnsight-version"


def _main() -> str:
    """The nnsight this package pins (a runtime's worker imports another one)."""
    for requirement in metadata.requires("ndif-celery") or ():
        name, _, pinned = requirement.partition("==")
        if name.strip() == "nnsight" and pinned:
            return pinned.split(";")[0].strip()
    return metadata.version("nnsight")


#: The farm's own nnsight: every worker runs it but a runtime's.
MAIN = _main()
PYTHON_HEADER = "python-version"

_MAJOR_MINOR = re.compile(r"^\s*(\d+)\.(\d+)")


class VersionRefused(Refused, ValueError):
    """A client below a configured minimum: 400 with NDIF's ``detail`` (``errors.Refused``)."""

    status = 400


def parse_minimum(name: str, raw: str) -> str:
    """A configured minimum as given, or ``""`` (off); a malformed one is a
    configuration error, raised at startup rather than as a 500 per request."""
    raw = (raw or "").strip()
    if not raw:
        return ""
    try:
        Version(raw)
    except InvalidVersion:
        raise ValueError(f"{name} must be a version such as 0.8.1 (or unset), got {raw!r}") from None
    return raw


def python_major_minor(sys_version: str) -> Optional[str]:
    """``"3.11"`` from a ``sys.version`` string such as ``"3.11.9 (main, ...) [GCC ...]"``."""
    match = _MAJOR_MINOR.match(sys_version or "")
    return f"{int(match.group(1))}.{int(match.group(2))}" if match else None


def _require_reported(what: str, client_version: Optional[str]) -> None:
    """NDIF's refusal of a request that did not say its ``what`` version at all."""
    if not client_version:
        raise VersionRefused(
            f"Client {what} version was not provided. This usually means an "
            "outdated nnsight; please `pip install --upgrade nnsight` and retry."
        )


def check_nnsight(client_version: Optional[str], minimum: str) -> None:
    if not minimum:
        return
    _require_reported("nnsight", client_version)
    try:
        client = Version(client_version)
    except InvalidVersion:
        raise VersionRefused(f"Malformed nnsight version '{client_version}'.") from None
    if client < Version(minimum):
        raise VersionRefused(
            f"Client nnsight version {client_version} is below the minimum supported {minimum}. "
            "Please `pip install --upgrade nnsight`."
        )


def check_python(client_version: Optional[str], minimum: str) -> None:
    """Like ``check_nnsight`` in shape, apart on purpose: python is compared on
    major.minor of a ``sys.version`` string, nnsight on its full version, and
    each answers with NDIF's own wording."""
    if not minimum:
        return
    _require_reported("python", client_version)
    major_minor = python_major_minor(client_version)
    if major_minor is None:
        raise VersionRefused(f"Malformed python version '{client_version}'.")
    floor = Version(minimum)
    if Version(major_minor) < Version(f"{floor.major}.{floor.minor}"):
        raise VersionRefused(
            f"Client python version {major_minor} is below the minimum supported {minimum}. Please update python."
        )


def as_runtime(version: str) -> str:
    """The runtime that serves ``version``: itself, or "" for the farm's own (or none said)."""
    return "" if not version or version == MAIN else version


#: A runtime built on another Python minor than the farm's is named for both:
#: ``0.5.15+py3.12`` (a PEP 440 local label, so it still sorts and compares as 0.5.15).
MINOR_LABEL = "+py"
#: One exact nnsight release (``fullmatch``): what a runtime is added as.
RELEASE = re.compile(r"\d+\.\d+\.\d+(?:\.post\d+)?")
#: A runtime's name (``fullmatch``): its release, with the minor label on another Python minor.
RUNTIME_NAME = re.compile(rf"{RELEASE.pattern}(?:{re.escape(MINOR_LABEL)}\d+\.\d+)?")


def runtime_name(version: str, minor: str) -> str:
    """The runtime of nnsight ``version`` on Python ``minor`` (not the farm's own minor)."""
    return f"{version}{MINOR_LABEL}{minor}"


def release_of(runtime: str) -> str:
    """The nnsight release a runtime serves: ``0.5.15`` for ``0.5.15+py3.12``."""
    return runtime.split(MINOR_LABEL, 1)[0]


def served(workers: dict, main: str) -> set:
    """The nnsight versions the farm runs: its own, and each live worker's
    (``nnsight`` in its registry entry: a worker of another runtime)."""
    return {main} | {release_of(info["nnsight"]) for info in workers.values() if info.get("nnsight")}


def runtime_for(workers: dict, version: str, client_python: Optional[str]) -> str:
    """The live runtime that serves a ``version`` client on its Python minor.

    Only a bytecode payload (0.5) cares: it goes to a runtime whose workers
    run the client's minor, the plain ``version`` first. Any other client
    goes to its version's plain runtime."""
    if not sends_bytecode(version):
        return as_runtime(version)
    minor = python_major_minor(client_python or "")
    names = {info["nnsight"] for info in workers.values()
             if release_of(info.get("nnsight") or "") == version and info.get("python") == minor}
    return version if version in names or not names else sorted(names)[0]


def check_runtime(client_version: Optional[str], main: str, served_now: Callable[[], set],
                  added_here: Callable[[], set] = set) -> None:
    """A request runs only under its client's own nnsight: the farm's (``main``),
    or a version a live worker serves (``served_now``, read only for another
    version). A client from a source tree sends ``""``: taken as the farm's.
    The refusal names the client's version and the versions served, in the
    ``detail`` every client shows, and what the operator is to do: add the
    runtime, or start a worker of one already added (``added_here``)."""
    if not client_version or client_version == main:
        return
    versions = served_now()
    if client_version in versions:
        return
    listed = ", ".join(sorted(versions, key=_order))
    if client_version in added_here():
        operator = (f"ask the farm's operator to start a worker of it: its runtime is added but no worker of it "
                    f"runs (`ndif-celery worker --nnsight {client_version}`, or NDIF_RUNTIMES)")
    else:
        operator = f"ask the farm's operator to add {client_version} (`ndif-celery runtime add {client_version}`)"
    raise VersionRefused(
        f"This farm does not serve nnsight {client_version}: a request runs only under the client's own "
        f"nnsight version, and this farm serves nnsight {listed}. Install one of those "
        f"(`pip install nnsight=={sorted(versions, key=_order)[-1]}`), or {operator}."
    )


#: The first version whose clients speak the farm's own protocol (``WS /subscribe``,
#: a multipart ``POST /request``); older ones speak Socket.IO (``socketio_wire``).
OWN_PROTOCOL_SINCE = Version("0.8.0")


def protocol_of(version: str) -> str:
    """The protocol an nnsight ``version``'s client speaks ("" the farm's own, or "socketio")."""
    try:
        return "" if Version(version) >= OWN_PROTOCOL_SINCE else socketio_wire.PROTOCOL
    except InvalidVersion:
        return ""


#: The first version whose clients send their block as source. Older ones
#: (0.5) send CPython bytecode, zlib'd: it runs only on their own Python minor.
SOURCE_SINCE = Version("0.6.0")
#: The oldest version this farm has an adapter for. 0.4 sends a graph, not code.
OLDEST_SERVED = Version("0.5.0")


def sends_bytecode(version: str) -> bool:
    return _below(version, SOURCE_SINCE)


def payload_codec(version: str) -> str:
    """How an nnsight ``version``'s client compresses its payload (``wire.ZSTD`` or ``wire.ZLIB``)."""
    return wire.ZLIB if sends_bytecode(version) else wire.ZSTD


def _below(version: str, bound: Version) -> bool:
    try:
        return Version(version) < bound
    except InvalidVersion:
        return False


def check_served_at_all(client_version: Optional[str]) -> None:
    """A client older than any adapter: no runtime can serve it, so no operator step is offered."""
    if client_version and _below(client_version, OLDEST_SERVED):
        raise VersionRefused(
            f"This farm does not serve nnsight {client_version}: clients before {OLDEST_SERVED} send their "
            f"code as a graph this farm does not run. Install nnsight {OLDEST_SERVED} or later "
            f"(`pip install --upgrade nnsight`)."
        )


def python_minors(workers: dict, version: str) -> set:
    """The Python major.minor of each live worker of the ``version`` runtime."""
    return {info["python"] for info in workers.values()
            if release_of(info.get("nnsight") or "") == version and info.get("python")}


def check_python_minor(client_version: Optional[str], client_python: Optional[str], minors: set) -> None:
    """A bytecode payload (0.5) runs only on the Python minor that made it:
    some live worker of that runtime must run the client's minor. The refusal
    names the minors served and the operator's step to add another."""
    if not client_version or not sends_bytecode(client_version):
        return
    minor = python_major_minor(client_python or "")
    if minor in minors:
        return
    served_on = ", ".join(sorted(minors, key=Version)) or "none"
    said = f"Python {minor}" if minor else "a Python version it did not say"
    raise VersionRefused(
        f"This farm serves nnsight {client_version} on Python {served_on} only, and your client runs {said}: "
        f"an nnsight {client_version} request carries its code as Python bytecode, which runs only on the "
        f"Python minor version that made it. Run your client on Python {served_on.split(', ')[0]}, or ask the "
        f"farm's operator to add a runtime on your Python (`ndif-celery runtime add {client_version} "
        f"--python /path/to/python{minor or '3.X'}`) and start a worker of it."
    )


def _order(version: str):
    try:
        return (0, Version(version))
    except InvalidVersion:
        return (1, Version("0"))


def check_client(headers, min_nnsight: str, min_python: str) -> None:
    """Gate one request on its headers (any mapping with ``.get``); nnsight first, as NDIF."""
    check_nnsight(headers.get(NNSIGHT_HEADER), min_nnsight)
    check_python(headers.get(PYTHON_HEADER), min_python)
