"""What talks to a stack from outside, as a researcher or an attacker would.

* ``remote``         pointing the nnsight client at a stack, polling, slow jobs, ``VARIANTS``.
* ``client_envs``    environments for older nnsight clients, made once per checkout.
* ``load``           many real clients at once; ``COBATCH_TOLERANCE``.
* ``browser``        headless Chromium over the DevTools protocol (the dashboard).
* ``raw_websocket``  a ``/subscribe`` handshake and frames written by hand.
* ``signed_urls``    checking the store's presigned URLs (SigV4) and their query.
* ``metrics``        ``Scrape`` of a /metrics page and the deploy recipes' Prometheus rules.
"""
