"""What a stack publishes and stores about a job, read from its Redis.

The attacks on statuses read it (the jailed child's in
tests/e2e/isolation/test_security_channels.py, a trusted job's in
tests/e2e/api/test_output_bounds.py): a flood must reach neither the
websockets nor Redis unbounded.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import redis

STORED_LIMIT = 128 * 1024  # what Redis may keep as one job's status


@contextlib.contextmanager
def published(stack):
    """Every JSON status the stack publishes to websockets while the block runs."""
    client = redis.Redis.from_url(stack.redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("ndif:session:*")
    messages: list = []
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            message = pubsub.get_message(timeout=0.1)
            if message and isinstance(message["data"], bytes) and message["data"][:1] == b"{":
                messages.append(json.loads(message["data"]))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield messages
    finally:
        time.sleep(0.3)
        stop.set()
        thread.join()
        pubsub.close()
        client.close()


def stored_status(stack, job_id: str) -> bytes:
    return redis.Redis.from_url(stack.redis_url).get(f"ndif:job:{job_id}:status")


def the_job(messages) -> str:
    """The one job whose statuses were published (a blocking client keeps no job id)."""
    (job_id,) = {m["id"] for m in messages}
    return job_id


def logs_of(messages):
    return [m["description"] for m in messages if m["status"] == "LOG"]
