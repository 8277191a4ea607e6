"""``up`` on a host where the farm's ports are taken: each taken port is named
with the variable that moves it, before anything starts (a service that cannot
bind dies in its log, a worse place to learn it)."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from ndif_celery import config
from ndif_celery.host import stack


def _taken() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_every_taken_port_is_named_with_its_variable(tmp_path):
    held = [_taken() for _ in range(3)]
    try:
        web, redis_port, flower = (sock.getsockname()[1] for sock in held)
        settings = dataclasses.replace(config.load({"NDIF_HOME": str(tmp_path)}), api_host="127.0.0.1",
                                       api_port=web, embedded_redis_port=redis_port, flower_host="127.0.0.1",
                                       flower_port=flower)
        with pytest.raises(stack.StackError) as refused:
            stack._check_ports(settings, ["web", "redis", "flower", "worker"])
        said = str(refused.value)
        for port, variable in [(web, "NDIF_API_PORT"), (redis_port, "NDIF_EMBEDDED_REDIS_PORT"),
                               (flower, "NDIF_FLOWER_PORT")]:
            assert f"port {port} is already in use" in said and f"{variable}=<port>" in said, said
    finally:
        for sock in held:
            sock.close()
    stack._check_ports(settings, ["web", "redis", "flower"])  # free again: nothing to say
