"""Leases (``ndif_celery.state.leases``): two holders of one key against a real
embedded Redis. One leads and the other waits; renewing keeps the lease past
its time; it passes over once it expires, or at once when its holder releases it.
"""

from __future__ import annotations

import time

from ndif_celery.state import leases

KEY = "ndif:test:leader"
MS = 300


def _pair(client) -> tuple[leases.Lease, leases.Lease]:
    return leases.Lease(client, KEY, "first", MS), leases.Lease(client, KEY, "second", MS)


def test_one_holder_leads_and_the_other_does_not(redis_client):
    first, second = _pair(redis_client)
    assert first.hold() and not second.hold()
    assert first.hold(), "its holder renews it"
    assert not second.hold()
    assert redis_client.get(KEY) == b"first"
    assert 0 < redis_client.pttl(KEY) <= MS


def test_renewal_keeps_the_lease_past_its_time(redis_client):
    first, second = _pair(redis_client)
    assert first.hold()
    deadline = time.monotonic() + 3 * MS / 1000
    while time.monotonic() < deadline:
        time.sleep(MS / 4000)
        assert first.hold() and not second.hold()
    assert redis_client.get(KEY) == b"first"


def test_the_lease_passes_over_when_it_expires(redis_client):
    first, second = _pair(redis_client)
    assert first.hold()
    time.sleep(2 * MS / 1000)  # the holder stopped renewing: it died
    assert second.hold() and not first.hold()
    assert redis_client.get(KEY) == b"second"


def test_release_hands_it_over_at_once_and_only_by_its_holder(redis_client):
    first, second = _pair(redis_client)
    assert first.hold()
    second.release()
    assert redis_client.get(KEY) == b"first", "one that does not hold it cannot release it"
    first.release()
    assert redis_client.get(KEY) is None
    assert second.hold() and not first.hold()


def test_lead_ticks_only_while_held_and_outlives_a_failed_tick(redis_client, caplog):
    import logging
    import threading

    first, second = _pair(redis_client)
    ticks = {"first": 0, "second": 0}
    stopping = threading.Event()

    def tick_of(name):
        def tick():
            ticks[name] += 1
            if name == "first" and ticks[name] == 1:
                raise RuntimeError("one bad pass")
            if ticks["first"] >= 5:
                stopping.set()
        return tick

    assert first.hold()  # the first copy leads from the start
    log = logging.getLogger("test.leases")
    threads = [threading.Thread(target=lease.lead, args=(tick_of(name), stopping, 0.01, log, name))
               for name, lease in (("first", first), ("second", second))]
    with caplog.at_level(logging.ERROR, logger="test.leases"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)
    assert ticks == {"first": 5, "second": 0}, "the holder ticks on after its failed pass; the other never"
    assert [record.getMessage() for record in caplog.records] == ["first failed"]
