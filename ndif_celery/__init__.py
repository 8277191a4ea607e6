"""ndif_celery: the shared core that the web, the workers, the beat and the CLI all import.

It imports neither ``workers`` nor ``web``, so the web can use it without
loading torch. This file imports nothing: a process that needs ``wire`` must
not pay for the rest.

Modules and subpackages, bottom layer first. Each imports only its own layer
or those below; ``tools/import_graph.py`` (``LAYERS``) enforces it.

1. Leaves:

``errors`` - ``Refused``, the one refusal type. The web answers it with one handler.
``exit_codes`` - the exit statuses a service and its supervisor agree on.
``output_bounds`` - caps on the status texts and LOG output user code can make.
``notices`` - a repeating warning, logged once per change, then as a rare reminder.
``log_limits`` - repeated log records of every farm process: a few per window, then a count.

2. The protocols and pure rules:

``wire`` - the nnsight 0.8.1 client's envelope and status frames, without torch.
``socketio_wire`` - the 0.6 and 0.7 clients' frames and headers, without torch.
``messages`` - status texts two processes write, kept once so they cannot drift.
``policy/`` - who may load which model or use a deployment, the client version gate,
  the jail's layer names.

3. Settings and the broker app:

``config`` - every ``NDIF_*`` setting, declared once in one table.
``config.pyi`` - the stub that types ``Settings`` for editors and mypy.
``celery_app`` - the JSON-only Celery app, one queue per model key.

4. ``state/`` - what every process reads and writes in Redis: job keys, the registry, queues, expiry.
5. ``store/`` - result bytes, on a filesystem or in S3, until the client downloads them.
6. ``accounts/`` - users and API keys, per-key limits, the job ledger, usage, the audit log.
7. ``monitoring/`` - farm-wide Prometheus series and the synthetic health probes.
8. ``statuses`` - ``StatusChannel``, the one writer of a job's statuses. It sits above
   everything a final status touches.
9. The web's door, the farm's control and the beat:

``intake`` - ``POST /request`` as named steps.
``farm/`` - who holds which model, operator actions, the beat's watchdog.
``beat`` - the ``ndif-celery beat`` process.

10. ``host/`` - this host's processes: the single-host stack, its supervisor, doctor, logs.
11. ``cli/`` - the ``ndif-celery`` command. Each command's module is imported only when it runs.

Each subpackage's ``__init__`` opens with its own map. The worker and the code
that runs jobs are ``workers``. The Flask app is ``web``. See docs/architecture.md.
"""
