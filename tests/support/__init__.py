"""Helpers the tests share (imported as ``from tests.support import stack`` or
``from tests.support.remote import poll``); no test lives here.

* ``paths``          ROOT, TESTS_DIR, OUT_DIR (tests/_out), E2E_DIR.
* ``pace``           wall-time bounds scaled by this machine's speed and load (``pace.bound``).
* ``tiny_model``     tiny offline GPT-2 checkpoints, PROMPT/REPO_ID and the client model.
* ``conformance``    the conformance cases every remote backend must pass, and ``same``.
* ``servers``        real servers on loopback: embedded Redis, moto's S3, a TCP proxy,
                     a PostgreSQL database per test, a webhook ``Receiver``; and
                     ``refuse_in_fast_tier``, the guard that keeps stacks out of the fast tier.
* ``stack``          ``Stack``: the real single-host stack through the real CLI (``up``),
                     and ``client_on_stack``.
* ``launcher``       warm starts of Celery workers: forked from a process that imported torch
                     (``Stack(warm=True)``; ``warm_start/sitecustomize.py`` is the worker's shim).
* ``status_feed``    what a stack publishes and stores about a job (the output-bound attacks).
* ``stack_pool``     ``StackPool``: one shared stack per kind (fs, s3, isolated, zygote ...)
                     behind the ``stack_pool``/``fs_stack``/``variant`` fixtures.
* ``remote``         pointing the nnsight client at a stack, polling, slow jobs, VARIANTS.
* ``jail_fixtures``  the attack suites' ``jail``/``worker_pid``/``still_serving_after``
                     fixtures, ``attempt``, and the host's UNIX sockets as targets.
* ``load``           many real clients at once; COBATCH_TOLERANCE.
* ``netns``          hosts as Linux network namespaces on one machine.
* ``host_farm``      a farm over six ``netns`` hosts, each running its services from the CLI.
* ``browser``        headless Chromium over the DevTools protocol (the dashboard).
* ``deploy_recipes`` parsing the deploy recipes (Procfile, compose, systemd) against the CLI.
* ``waiting``        ``wait_until``: call a check until it holds, or fail naming what was awaited.
* ``signed_urls``    checking the store's presigned URLs (SigV4) and their query.
* ``metrics``        ``Scrape`` of a /metrics page and the deploy recipes' Prometheus rules.
* ``doctor``         ``checks``: ``ndif-celery doctor``'s output as name -> (state, detail).
* ``raw_websocket``  a ``/subscribe`` handshake and client frames written by hand (the web's attacks).
"""
