"""The farm's control: which worker holds which model, operator actions, and the beat's watchdog.

Bottom first; none of it imports torch:

- ``placement``: best fit with LRU eviction, as pure functions, so every rule is easy to test.
- ``sizing``: a model's memory before it is loaded (safetensors headers, else
  nnsight's estimate), padded for activations.
- ``actions``: operator actions (deploy, evict, kill) written as wishes in
  Redis or sent as tasks to a worker's own queue.
- ``deployments``: declarative deployments (``deploy -f``, ``NDIF_DEPLOYMENTS``),
  a file checked whole, written as wishes; ``scale``; a deployment's ``users``.
- ``schedules``: scheduled pins, windows in Redis reconciled by the controller every tick.
- ``controller``: ``Controller``, a thread in every worker with one leading
  (a Redis lease): placement, replicas, idle retirement, queue positions.
- ``watchdog``: ``FarmWatchdog``, a thread of ``ndif-celery beat``: it rescues
  a dead worker's jobs, answers jobs past their recorded deadline, finds lost
  deliveries and tells jobs nobody serves. It lives in the beat because it must
  keep looking when every worker is dead. Not ``workers.job.deadline``'s
  ``DeadlineWatchdog``, a worker's own thread that ends its job at the limit.
"""
