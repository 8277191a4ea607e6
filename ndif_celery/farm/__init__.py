"""The farm's control: which worker holds which model, operator actions, the beat's watchdog, elastic workers.

None of it imports torch. Bottom first:

``placement`` - best fit with LRU eviction, as pure functions, so every rule is easy to test.
``sizing`` - a model's memory before it is loaded, padded for activations. It reads
  safetensors headers, else nnsight's estimate.
``actions`` - operator actions (deploy, evict, kill), written as wishes in Redis or
  sent as tasks to a worker's own queue.
``capacity`` - whether the live workers can meet a wish, checked before it is recorded.
``deployments`` - declarative deployments (``deploy -f``, ``NDIF_DEPLOYMENTS``): a file
  checked whole, written as wishes. Also ``scale`` and a deployment's ``users``.
``schedules`` - scheduled pins: windows in Redis, reconciled by the controller every tick.
``wanted`` - what the farm was asked to keep, beside what it runs: ``ndif-celery
  deployments``, ``export``.
``controller`` - ``Controller``, a thread in every worker, one leading by a Redis lease.
  It runs placement, replicas, idle retirement and queue positions.
``watchdog`` - ``FarmWatchdog``, a thread of ``ndif-celery beat``. It rescues a dead
  worker's jobs and answers jobs past their recorded deadline. It finds lost
  deliveries and tells jobs nobody serves. It lives in the beat so it keeps
  looking when every worker is dead. Not ``workers.job.deadline``'s
  ``DeadlineWatchdog``, a worker's own thread that ends its job at the limit.
``launchers`` - how to ask a cluster's scheduler for a worker: ``SlurmLauncher``
  submits, reads and cancels batch jobs. Another scheduler is another class.
``elastic`` - ``Elastic``, a thread of ``ndif-celery beat`` with ``NDIF_LAUNCHER`` set.
  It launches a worker when a model's jobs wait, and follows each launch.
"""
