"""The Python and package versions a process runs with, for ``GET /env``.

Keyed by import name where one is known, like ``nnsight.ndif.get_local_env``,
so ``nnsight.compare()`` lines our packages up with the client's. Workers
publish theirs to Redis (they run the user's code, so theirs is what matters);
the web falls back to its own when no worker has reported yet.
"""

from __future__ import annotations

import sys
from importlib import metadata


def local_env() -> dict:
    imports: dict[str, list[str]] = {}
    for import_name, dists in metadata.packages_distributions().items():
        for dist in dists:
            imports.setdefault(dist, []).append(import_name)
    packages = {}
    for dist in metadata.distributions():  # in import order: a runtime's nnsight before the farm's it shadows
        name = dist.metadata["Name"]
        for import_name in imports.get(name, [name]):
            packages.setdefault(import_name, dist.version)
    return {"python_version": sys.version, "packages": packages}
