"""This host's processes: the single-host stack, its supervisor, and the checks an operator runs.

Bottom first:

``embedded_redis`` - the embedded Redis's binary and arguments, so a fresh machine needs nothing else.
``processes`` - a recorded service process: alive (safe against pid reuse), its exit
  status, its process group stopped.
``log_rotation`` - the logs under ``NDIF_HOME/logs``, kept to a size. The supervisor
  rotates them in place.
``runtimes`` - client runtimes: another nnsight, in a virtual environment of its own,
  for workers that serve that client's version.
``services`` - each service's command line and environment. One table serves ``up``
  and ``ndif-celery web|worker|beat|flower|redis`` in the foreground.
``stack`` - ``up``'s stack: state file, ports, launch, readiness, stop.
``supervisor`` - ``up``'s supervisor: it restarts a service that dies, with backoff.
``logs`` - ``ndif-celery logs``, the tail of a service's log file.
``versions`` - ``ndif-celery version``, what this host has installed. Not
  ``policy.client_versions``, the gate on the client's versions.
``environment`` - the Python and package versions a process runs with, for ``GET /env``.
``doctor`` - ``ndif-celery doctor``, each check with its fix. It probes the jail with
  the jail's own code: the one allowed edge to ``workers``.
"""
