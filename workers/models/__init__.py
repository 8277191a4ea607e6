"""The models a worker keeps loaded, what memory they may take, and whether their weights changed.

Not ``ndif_celery.policy.model_policy`` (``ModelPolicy``: which models may load for
whom), nor ``ndif_celery.farm`` (which worker holds which model). Bottom first:

- ``memory``: a worker's memory budget, from ``nvidia-smi`` or RAM, without
  touching CUDA (a process that will fork must not initialise it).
- ``integrity``: weight fingerprints: cheap ``Stamps`` after every trusted job,
  the whole fingerprint when due, a keyed hash after untrusted jobs that could write.
- ``resident``: ``Resident`` (one model, with its weights' shared mapping,
  fingerprints and zygote, all let go by ``close()``) and ``ResidentModels``
  (load, evict, reload after a changed fingerprint).
"""
