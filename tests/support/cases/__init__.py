"""What the tests send and what they check it against.

* ``tiny_model``       tiny offline GPT-2 checkpoints, ``PROMPT``/``REPO_ID`` and the client model.
* ``tiny_multimodal``  tiny offline LLaVA, T5 and Whisper checkpoints and their client models.
* ``tiny_diffusion``   a tiny offline Stable Diffusion pipeline (``ndif-celery/tiny-sd``) and its ``DiffusionModel``.
* ``conformance``      the cases every remote backend must pass, and ``same``.
* ``old_client_cases`` the same cases in the 0.6 and 0.7 clients' API.
* ``cobatch_cases``    prompts and requests the co-batching engine's tests share.
* ``model_state``      what a request can change on a shared model, read back later.
* ``worker_jobs``      jobs for the worker's job function in the test process.
* ``jail_fixtures``    the attack suites' ``jail``/``worker_pid``/``still_serving_after``
                       fixtures, ``attempt``, and the host's UNIX sockets as targets.
"""
