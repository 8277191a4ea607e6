"""Which services a single-host stack runs, and their command lines, from settings alone."""

from __future__ import annotations

import pytest

from ndif_celery import config
from ndif_celery.host import services


def test_flower_port_0_leaves_flower_out(tmp_path):
    on = config.load({"NDIF_HOME": str(tmp_path)})
    off = config.load({"NDIF_HOME": str(tmp_path), "NDIF_FLOWER_PORT": "0"})
    assert services.default_services(on)[-1] == "flower"
    assert "flower" not in services.default_services(off)
    assert services.default_services(off)[:2] == ["redis", "web"]
    assert on.flower_url.endswith(":5555") and off.flower_url == ""  # the dashboard shows no link
    with pytest.raises(services.StackError, match="NDIF_FLOWER_PORT=0"):
        services.command(off, "flower")
