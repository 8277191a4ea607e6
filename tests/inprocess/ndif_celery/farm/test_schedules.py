"""Scheduled pins (``ndif_celery.farm.schedules``) in the fast tier: the times an
operator types, the windows refused, and :func:`reconcile` (what the
controller does every tick) against a real embedded Redis, with the clock
passed in: a window pins the model, the wish it replaced comes back when it
closes, a model nothing else wanted is released for eviction. A real farm
loading and evicting on time is tests/e2e/farm/test_operations.py.
"""

from __future__ import annotations

import datetime
import json

import pytest

from ndif_celery.farm import actions
from ndif_celery.farm import deployments, schedules
from ndif_celery.farm.schedules import ScheduleError
from ndif_celery.state import registry

NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc).timestamp()
KEY = actions.model_key_for("org/course")


def test_times_are_now_spans_from_now_or_iso_in_utc():
    assert schedules.parse_when("now", NOW) == NOW
    assert schedules.parse_when("+90s", NOW) == NOW + 90
    assert schedules.parse_when("+2h", NOW) == NOW + 7200
    assert schedules.parse_when("+1.5d", NOW) == NOW + 1.5 * 86400
    assert schedules.parse_when("2026-12-01T13:00", NOW) == NOW + 3600
    assert schedules.parse_when("2026-12-01T13:00+01:00", NOW) == NOW
    with pytest.raises(ScheduleError, match=r"--to must be now, \+<n>.*got 'tomorrow'"):
        schedules.parse_when("tomorrow", NOW, option="--to")


@pytest.mark.parametrize("start, end, says", [
    (NOW + 60, NOW + 30, "ends .* before it starts"),
    (NOW - 120, NOW - 60, "ended already"),
    (NOW, NOW + 400 * 86400, "at most 366"),
])
def test_windows_that_cannot_be_are_refused(redis_client, start, end, says):
    with pytest.raises(ScheduleError, match=says):
        schedules.add(redis_client, KEY, "org/course", start, end, now=NOW)
    assert redis_client.hlen(schedules.SCHEDULES) == 0


def test_a_window_pins_the_model_and_releases_it_when_it_closes(redis_client):
    entry = schedules.add(redis_client, KEY, "org/course", NOW + 60, NOW + 120, replicas=2, now=NOW)
    assert schedules.entries(redis_client, NOW)[0]["state"] == "pending"
    assert schedules.reconcile(redis_client, NOW) == [] and registry.desired(redis_client) == {}

    assert schedules.reconcile(redis_client, NOW + 60) == []
    wish = registry.desired(redis_client)[KEY]
    assert wish["pinned"] is True and wish["replicas"] == 2 and wish["schedule"] == [entry["id"]]
    assert schedules.entries(redis_client, NOW + 60)[0]["state"] == "active"
    assert schedules.reconcile(redis_client, NOW + 90) == [], "an open window is left as it is"

    assert schedules.reconcile(redis_client, NOW + 120) == [KEY], "nothing else wants it: evict"
    assert registry.desired(redis_client) == {}
    assert schedules.entries(redis_client, NOW + 120)[0]["state"] == "ended"
    schedules.reconcile(redis_client, NOW + 120 + schedules.KEEP_ENDED_S + 1)
    assert schedules.entries(redis_client) == [], "ended windows are forgotten after a day"


def test_the_wish_it_replaced_comes_back_unevicted(redis_client):
    actions.deploy(redis_client, KEY, pinned=False, replicas=1, dtype="bfloat16")
    before = registry.desired(redis_client)[KEY]
    schedules.add(redis_client, KEY, "org/course", NOW, NOW + 60, now=NOW)
    schedules.reconcile(redis_client, NOW)
    pinned = registry.desired(redis_client)[KEY]
    assert pinned["pinned"] is True and pinned["dtype"] == "bfloat16" and pinned["before"] == before
    assert schedules.reconcile(redis_client, NOW + 60) == []
    assert registry.desired(redis_client)[KEY] == before


def test_overlapping_windows_keep_it_pinned_until_the_last_closes(redis_client):
    first = schedules.add(redis_client, KEY, "org/course", NOW, NOW + 60, now=NOW)
    second = schedules.add(redis_client, KEY, "org/course", NOW + 30, NOW + 90, replicas=3, now=NOW)
    schedules.reconcile(redis_client, NOW)
    schedules.reconcile(redis_client, NOW + 30)
    wish = registry.desired(redis_client)[KEY]
    assert wish["schedule"] == sorted([first["id"], second["id"]]) and wish["replicas"] == 3
    assert schedules.reconcile(redis_client, NOW + 60) == []
    assert registry.desired(redis_client)[KEY]["schedule"] == [second["id"]]
    assert schedules.reconcile(redis_client, NOW + 90) == [KEY]


def test_a_deploy_during_the_window_is_what_comes_back_after(redis_client):
    schedules.add(redis_client, KEY, "org/course", NOW, NOW + 60, now=NOW)
    schedules.reconcile(redis_client, NOW)
    actions.deploy(redis_client, KEY, pinned=False, replicas=1, dtype=None)  # overwrites the pinned wish
    schedules.reconcile(redis_client, NOW + 1)
    wish = registry.desired(redis_client)[KEY]
    assert wish["pinned"] is True and wish["before"]["source"] == "cli", "pinned again until the window closes"
    assert schedules.reconcile(redis_client, NOW + 60) == []
    assert registry.desired(redis_client)[KEY]["source"] == "cli"


def test_a_file_sync_during_the_window_lets_it_go_when_the_window_closes(redis_client):
    deployments.apply(redis_client, deployments.parse("- repo: org/course\n"))
    schedules.add(redis_client, KEY, "org/course", NOW, NOW + 60, now=NOW)
    schedules.reconcile(redis_client, NOW)
    synced = deployments.apply(redis_client, [], sync=True, celery_app=object(), force=True)
    assert synced.evicted == [("org/course", KEY, [])], "not evicted while pinned by the window"
    assert registry.desired(redis_client)[KEY]["pinned"] is True
    assert schedules.reconcile(redis_client, NOW + 60) == [KEY]


def test_removing_an_open_window_closes_it(redis_client):
    entry = schedules.add(redis_client, KEY, "org/course", NOW, NOW + 60, now=NOW)
    schedules.reconcile(redis_client, NOW)
    assert schedules.remove(redis_client, entry["id"])["repo"] == "org/course"
    assert schedules.remove(redis_client, entry["id"]) is None
    assert schedules.reconcile(redis_client, NOW + 1) == [KEY]
    assert json.dumps(registry.desired(redis_client)) == "{}"
