"""workers: the Celery worker that keeps models resident and runs researchers' code against them.

It sits on ``ndif_celery``, the shared core, and never imports ``web``. This
file imports nothing: Flower runs ``celery -A workers.tasks:app`` too, and
must load no torch.

Modules and subpackages, bottom layer first, as ``tools/import_graph.py``
(``LAYERS``) enforces:

1. ``adapters/`` - what differs per nnsight version a worker runs: the farm's own, or a runtime's.
2. Leaves shared by the worker and the jailed child:

``execute`` - deserialize a request, run its block, collect the saves, with the hygiene around them.
``baseline`` - a resident model's user-changeable state as loaded, put back after each trusted request.
``results`` - result bytes as the nnsight client reads them, and the pickled COMPLETED frame.
``cuda`` - what this process did with CUDA. A process that initialised it cannot fork.
``quantized`` - a quantized model's bitsandbytes layers: settled at load, rebuilt in a skeleton.
``metrics`` - this worker's own Prometheus endpoint. Not ``ndif_celery.monitoring.metrics``, the farm's.

3. ``isolation/`` - untrusted jobs: the zygotes, the jailed child per request, the frames, the jail.
4. ``models/`` - the resident models, their memory budget, their threads and their weight checks.
5. ``cobatch/`` - several trusted requests on one model in one batched forward.
6. ``job/`` - a job's life on a worker: the job slot, the steps, the executors, deadlines,
   deliveries, co-batch gathering.
7. ``startup`` - the worker process's first steps at ``worker_init``: GPUs, threads, the fork server.
8. ``worker`` - ``WorkerState``, what lives for the whole process: clients, models, executors, heartbeat.
9. ``tasks`` - the Celery entry point: the app, the task wrappers, ``ndif_kill``, the signals.

Each subpackage's ``__init__`` opens with its own map. See docs/architecture.md.
For a job's path through these, see docs/jobs.md.
"""
