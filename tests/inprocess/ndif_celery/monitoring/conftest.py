"""What the monitoring tests share: a webhook receiver on loopback, one per test."""

from __future__ import annotations

import pytest

from tests.support.stacks.webhook import Hook


@pytest.fixture
def hook():
    server = Hook().start()
    yield server
    server.stop()
