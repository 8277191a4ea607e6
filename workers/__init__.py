"""workers: the Celery worker that keeps models resident and runs researchers' code against them.

It sits on ``ndif_celery`` (the shared core) and never imports ``web``. This
file imports nothing: ``celery -A workers.tasks:app`` is imported by the beat
and Flower too, which must load no torch. Bottom layer first, as
``tools/import_graph.py`` (``LAYERS``) enforces:

1. ``adapters/``: what differs per nnsight version a worker runs (the farm's own, or a runtime's);
2. leaves shared by the worker and the jailed child:
   ``execute`` (deserialize a request, run its block, collect the saves, the hygiene around them);
   ``baseline`` (a resident model's user-changeable state as loaded, put back after each trusted request);
   ``results`` (result bytes as the nnsight client reads them, and the pickled COMPLETED frame);
   ``cuda`` (what this process did with CUDA: a process that initialised it cannot fork);
   ``metrics`` (this worker's own Prometheus endpoint; not ``ndif_celery.monitoring.metrics``, the farm's);
3. ``isolation/``: untrusted jobs: the zygotes, the jailed child per request, the frames, the jail;
4. ``models/``: the resident models, their memory budget and their weight checks;
5. ``cobatch/``: several trusted requests on one model in one batched forward;
6. ``job/``: a job's life on a worker: the job slot, the steps, the executors, deadlines, deliveries,
   co-batch gathering;
7. ``startup``: the worker process's first steps at ``worker_init`` (GPUs, threads, the fork server);
8. ``worker``: ``WorkerState``, what lives for the whole process: clients, models, executors, heartbeat;
9. ``tasks``: the Celery entry point: the app, the task wrappers, ``ndif_kill``, the signals.

Each subpackage's ``__init__`` opens with its own map. See docs/architecture.md
and, for a job's path through these, docs/jobs.md.
"""
