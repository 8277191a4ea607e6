"""The models a worker keeps loaded, what memory they may take, and whether their weights changed.

Not ``ndif_celery.policy.model_policy``, whose ``ModelPolicy`` says which models may
load for whom. Nor ``ndif_celery.farm``, which says which worker holds which
model. Bottom first:

``memory`` - a worker's memory budget, from ``nvidia-smi`` or RAM, without touching
  CUDA. A process that will fork must not initialise it.
``integrity`` - weight fingerprints. Cheap ``Stamps`` after every trusted job, the
  whole fingerprint when due. A keyed hash after untrusted jobs that could write.
``threads`` - how many intra-op threads a model's forward gets, chosen when it loads.
``resident`` - ``Resident``, one model with its weights' shared mapping, fingerprints
  and zygote, all let go by ``close()``. ``ResidentModels`` loads, evicts, and
  reloads after a changed fingerprint.
"""
