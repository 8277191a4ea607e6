"""Untrusted jobs: a fresh jailed child per request, forked by a clean zygote, never by the worker.

The worker holds secrets and what earlier jobs left in its memory. So a child
that runs untrusted code must come from a process that holds neither. Bottom
first (docs/security.md, "The isolated path"):

``frames`` - the byte protocol between the worker and a child, and each frame
  kind's size limit, written once for both sides.
``control_channel`` - the JSON channel the fork server and a zygote share with the
  worker: replies, requests, children reaped and reported.
``jail/`` - the kernel-enforced confinement a child locks itself into. Its
  ``__init__`` is the one face its callers use.
``child`` - what runs inside the child: jail itself, take the request, run it, send frames.
``parent`` - the worker's side. ``run`` runs a request in a child, or a ready
  ``Spare``, under an ``IsolationPolicy``: timeout, memory, what it may read.
  It reads the child's frames as hostile input. ``ChildOutcome`` is what comes
  back. Not ``ndif_celery.policy.model_policy``'s ``ModelPolicy``, nor
  ``workers.cobatch``'s ``Outcome``.
``shared_weights`` - a resident model's weights in memory a zygote can map, so
  children share them without a copy. memfd on CPU, CUDA IPC on GPU.
``zygote`` - a clean per-model process that forks the children. It is an exec'd
  interpreter (``NDIF_ISOLATION=zygote``) or a fork of the fork server.
``forkserver`` - ``NDIF_ISOLATION=fork``: a pristine fork of the worker that forks
  the zygotes. It is taken at ``worker_init``, before any client, job or CUDA.
"""
