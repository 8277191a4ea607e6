"""ndif_celery: the shared core that the web, the workers, the beat and the CLI all import.

It imports neither ``workers`` nor ``web``, so the web can use any of it
without loading torch or a worker's code. This file imports nothing: a
process that needs ``wire`` must not pay for the rest. Modules and
subpackages, bottom layer first, as ``tools/import_graph.py`` (``LAYERS``)
enforces; each imports only its own layer or those below:

1. leaves:
   ``errors`` (``Refused``, the one refusal type the web answers with one handler);
   ``exit_codes`` (exit statuses a service and its supervisor agree on);
   ``output_bounds`` (caps on the status texts and LOG output user code can make);
   ``notices`` (a repeating warning logged once per change, then as a rare reminder);
   ``log_limits`` (repeated log records of every farm process: a few per source per window, then a count);
2. the protocol and pure rules:
   ``wire`` (the nnsight client's envelope and status frames, without torch);
   ``messages`` (status texts two processes write, kept once so they cannot drift);
   ``policy/`` (which models load for whom, who may use a deployment, the client version gate,
   the jail's layer names);
3. ``config`` (every ``NDIF_*`` setting, declared once in one table) and
   ``celery_app`` (the JSON-only Celery app, one queue per model key);
4. ``state/``: what every process reads and writes in Redis: job keys, the registry, queues, expiry;
5. ``store/``: result bytes, on a filesystem or in S3, until the client downloads them;
6. ``accounts/``: users and API keys, per-key limits, the job ledger and usage;
7. ``monitoring/``: farm-wide Prometheus series and the synthetic health probes;
8. ``statuses``: ``StatusChannel``, the one writer of a job's statuses, above all a final status touches;
9. ``intake`` (``POST /request`` as named steps, the web's door), ``farm/`` (who holds
   which model, operator actions, the beat's watchdog) and ``beat`` (the ``ndif-celery beat`` process);
10. ``host/``: this host's processes: the single-host stack, its supervisor, doctor, logs and their rotation;
11. ``cli/``: the ``ndif-celery`` command, each command's module imported only when it runs.

Each subpackage's ``__init__`` opens with its own map. The worker and the code
that runs jobs are ``workers``; the Flask app is ``web``. See docs/architecture.md.
"""
