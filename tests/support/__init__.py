"""Helpers the tests share; no test lives here.

Imported as ``from tests.support.stacks import stack`` or
``from tests.support.clients.remote import poll``.

* ``stacks/``     the real services a test starts: stacks, servers, hosts.
* ``clients/``    what talks to a stack from outside: the nnsight client, a browser, raw frames.
* ``cases/``      what the tests send and check: conformance cases, tiny models, attack fixtures.
* ``paths``       ROOT, TESTS_DIR, OUT_DIR (tests/_out), E2E_DIR.
* ``pace``        wall-time bounds scaled by this machine's speed and load (``pace.bound``).
* ``waiting``     ``wait_until``: call a check until it holds, or fail naming what was awaited.
* ``clocks``      clocks a test drives, for code that takes ``clock=``.
* ``scheduling``  the pytest plugin that says which pytest process runs which tests.
"""
