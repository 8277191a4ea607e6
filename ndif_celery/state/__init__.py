"""What every process reads and writes in Redis: job state, the farm's registry, the queues, expiry.

One package for the shared keys, so the web, the workers, the beat and the CLI
name and read them one way. Bottom first:

``jobs`` - the bottom of job state: key names, ``Job`` (the Celery message), the
  Redis client, the latest status. It imports nothing of the project but
  ``wire``. Not ``workers.job``, a job's life on a worker.
``registry`` - the farm's shared picture: live workers (heartbeats), deployments,
  operator wishes, the jobs each worker runs, ``/status``.
``queues`` - what waits in each per-model queue, read from the broker. ``take``
  removes a co-batch's jobs and records them as the worker's, in one Lua step.
``turns`` - fair turns between keys on a model's queue, and each key's bound on
  jobs running at once.
``run_times`` - how long each model's jobs took lately, for a waiting job's
  estimate (``position 3, about 40 s``).
``byte_quotas`` - the bytes each key holds in a shared place, against its quota:
  stored results, and what its jobs park in Redis.
``leases`` - ``Lease``, a key one holder at a time renews, so one copy of a thread
  leads. The controller, the ledger's drainer, the watchdog and the probes use it.
``launches`` - the record of each worker launched through a cluster's scheduler
  (``ndif_celery.farm.elastic``): its state and the scheduler's reason.
``expiry`` - the sweep the beat schedules for results and job state past
  ``NDIF_JOB_TTL_S``, and the "has expired" answer a late poll gets.

Publishing a status is one layer up, in ``ndif_celery.statuses``. A final status
also touches limits, the ledger and the metrics.
"""
