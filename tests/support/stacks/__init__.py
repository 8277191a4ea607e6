"""The real services a test starts, on loopback or in network namespaces.

* ``servers``        real servers: embedded Redis, moto's S3, a TCP proxy, a PostgreSQL
                     database per test, a webhook ``Receiver``; ``refuse_in_fast_tier``.
* ``stack``          ``Stack``: the real single-host stack through the real CLI (``up``).
* ``stack_pool``     ``StackPool``: one shared stack per kind, behind the ``stack_pool``,
                     ``fs_stack`` and ``variant`` fixtures.
* ``launcher``       warm starts of Celery workers, forked from a process that imported torch
                     (``warm_start/sitecustomize.py`` is the worker's shim).
* ``netns``          hosts as Linux network namespaces on one machine.
* ``host_farm``      a farm over six ``netns`` hosts, each running its services from the CLI.
* ``deploy_recipes`` the deploy recipes (Procfile, compose, systemd) parsed against the CLI.
* ``status_feed``    what a stack publishes and stores about a job.
* ``webhook``        an alert receiver that can be stopped and started again.
* ``doctor``         ``checks``: ``ndif-celery doctor``'s output as name -> (state, detail).
"""
