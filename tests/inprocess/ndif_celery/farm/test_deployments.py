"""Declarative deployments (``ndif_celery.farm.deployments``) in the fast tier: a file's
every mistake named by entry and field, who may use a deployment, and apply /
``--sync`` / ``scale`` against a real embedded Redis with the real Celery app
(evictions are the real messages on each worker's own queue). The farm doing
it (loads, evictions, ``/status``, ``up`` with ``NDIF_DEPLOYMENTS``) is
tests/e2e/farm/test_operations.py.
"""

from __future__ import annotations

import json
import time

import pytest

from ndif_celery.accounts import auth
from ndif_celery.celery_app import make_app, worker_queue
from ndif_celery.errors import Refused
from ndif_celery.farm import actions
from ndif_celery.farm import deployments
from ndif_celery.farm.deployments import DeploymentsError
from ndif_celery.policy import model_policy
from ndif_celery.state import registry


def _key(repo: str, revision=None) -> str:
    return actions.model_key_for(repo, revision=revision)


# --- parsing ----------------------------------------------------------------------


def test_a_yaml_file_becomes_checked_entries_with_canonical_keys(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(
        "deployments:\n"
        "  - repo: org/a\n    pin: true\n    replicas: 2\n    dtype: bfloat16\n"
        "    users: [Ada@Example.org, 'tag:trusted', 'key:12']\n"
        "  - repo: org/b\n    revision: v1\n"
    )
    a, b = deployments.load_file(path)
    assert (a.repo, a.pin, a.replicas, a.dtype) == ("org/a", True, 2, "bfloat16")
    assert a.users == ("ada@example.org", "tag:trusted", "key:12")
    assert a.model_key == _key("org/a") and b.model_key == _key("org/b", "v1")
    assert (b.pin, b.replicas, b.dtype, b.users) == (False, 1, None, ())
    assert a.wish() == {"pinned": True, "replicas": 2, "dtype": "bfloat16", "source": "file",
                        "users": ["ada@example.org", "tag:trusted", "key:12"]}


def test_json_and_an_inline_list_read_the_same():
    inline = '[{"repo": "org/a", "pin": true}]'
    assert deployments.from_setting(inline) == deployments.parse("- repo: org/a\n  pin: true\n")
    assert deployments.from_setting("") == []


@pytest.mark.parametrize("text, says", [
    ("- repo: org/a\n  replicas: two\n", "entry 1 (org/a): field `replicas` must be a whole number"),
    ("- repo: org/a\n- repo: org/b\n  replicas: 0\n", "entry 2 (org/b): field `replicas`"),
    ("- repo: org/a\n  pin: yes please\n", "entry 1 (org/a): field `pin` must be true or false"),
    ("- repo: org/a\n  dtype: int3\n", "entry 1 (org/a): dtype 'int3' is not one this farm loads"),
    ("- repo: org/a\n  users: ada@example.org\n", "entry 1 (org/a): field `users` must be a list"),
    ("- repo: org/a\n  users: [nobody]\n", "field `users`: 'nobody' is not an email"),
    ("- repo: org/a\n  users: ['tag:student']\n", "unknown tag 'student'"),
    ("- repo: org/a\n  replica: 2\n", "entry 1 (org/a): unknown field(s) replica"),
    ("- revision: main\n", "entry 1: field `repo` is required"),
    ("- repo: /etc/passwd\n", "entry 1 (/etc/passwd): 'repo' '/etc/passwd' is a path"),
    ("- repo: org/a\n- repo: org/a\n", "entry 2 (org/a) repeats entry 1"),
    ("- org/a\n", "entry 1: expected a mapping"),
    ("- repo: [unclosed\n", "not valid YAML or JSON at line"),
    ("models: []\n", "unknown top-level field(s) models"),
    ("repo: org/a\n", "unknown top-level field(s) repo"),
])
def test_a_bad_file_is_refused_naming_the_entry_and_field(text, says):
    with pytest.raises(DeploymentsError) as caught:
        deployments.parse(text, "models.yaml")
    assert says in str(caught.value) and str(caught.value).startswith("models.yaml")


def test_the_farms_model_policy_and_size_bounds_apply():
    policy = model_policy.ModelPolicy(models=("org/*",))
    with pytest.raises(DeploymentsError, match=r"entry 2 \(other/x\): Model 'other/x' is not served here"):
        deployments.parse("- repo: org/a\n- repo: other/x\n", "f", policy)
    many = "".join(f"- repo: org/m{i}\n" for i in range(deployments.MAX_ENTRIES + 1))
    with pytest.raises(DeploymentsError, match="at most 1000"):
        deployments.parse(many)


def test_a_missing_file_says_which(tmp_path):
    with pytest.raises(DeploymentsError, match="cannot read the deployments file .*nope.yaml"):
        deployments.from_setting(str(tmp_path / "nope.yaml"))


# --- who may use it -----------------------------------------------------------------


def test_intake_refuses_a_key_the_deployment_does_not_list(redis_client):
    key = _key("org/a")
    redis_client.hset(registry.DESIRED, key, json.dumps({"pinned": True, "users": ["ada@example.org"]}))
    deployments.check_access(redis_client, auth.Identity(key_id=1, email="ada@example.org"), key)
    with pytest.raises(Refused) as refused:
        deployments.check_access(redis_client, auth.Identity(key_id=2, email="bob@example.org"), key)
    assert refused.value.status == 403 and "for named users only" in refused.value.detail
    deployments.check_access(redis_client, auth.Identity(key_id=2), _key("org/not-deployed"))


def test_a_deployments_users_hold_for_every_name_of_its_weights(redis_client):
    """The wish names a commit; bob names the same weights by the default
    branch (None or "main"), by a tag, by the commit, by a task alias, and by a
    branch nobody recorded: refused each time. A commit known to differ is not
    this deployment."""
    sha, other_sha = "a" * 40, "b" * 40
    key = _key("org/a", sha).replace("text-generation", "token-classification")
    redis_client.hset(registry.DESIRED, key, json.dumps({"pinned": True, "users": ["ada@example.org"]}))
    registry.record_refs(redis_client, "org/a", {"main": sha, "v1": sha, "v2": other_sha})
    ada, bob = auth.Identity(key_id=1, email="ada@example.org"), auth.Identity(key_id=2, email="bob@example.org")
    try:
        for revision in (None, "main", "v1", sha, "v9"):
            for task in ("ner", "token-classification", "text-generation"):
                named = model_policy.parse(_key("org/a", revision).replace("text-generation", task)).key
                deployments.check_access(redis_client, ada, named)
                with pytest.raises(Refused, match="for named users only"):
                    deployments.check_access(redis_client, bob, named)
        for revision in ("v2", other_sha):
            deployments.check_access(redis_client, bob, _key("org/a", revision))
    finally:
        redis_client.delete(registry.DESIRED, "ndif:refs:org/a")


def test_warns_that_users_with_auth_off_refuse_everyone():
    entries = deployments.parse("- repo: org/a\n  users: [ada@example.org]\n- repo: org/b\n")
    assert [w.split(":")[0] for w in deployments.warnings(entries, auth=False)] == ["org/a"]
    assert deployments.warnings(entries, auth=True) == []


# --- apply, sync, scale (real Redis, real Celery messages) ---------------------------


@pytest.fixture
def app(embedded_settings):
    return make_app(embedded_settings)


def _worker_with(client, name: str, *model_keys: str, last_used: float = 0.0) -> None:
    registry.register_worker(client, {"name": name, "pid": 1, "memory_bytes": 1 << 30})
    for key in model_keys:
        registry.set_deployment(client, name, key, registry.RUNNING, last_used=last_used or time.time())


def _evictions(client, worker: str) -> list[str]:
    """The model keys of the evictions waiting on ``worker``'s own queue (Celery's messages)."""
    out = []
    for raw in client.lrange(worker_queue(worker), 0, -1):
        body = json.loads(raw)["body"]
        import base64

        args = json.loads(base64.b64decode(body))
        out.append(args[1]["model_key"])
    return out


def test_sync_evicts_only_what_a_file_deployed(redis_client, app):
    a, b, c = _key("org/a"), _key("org/b"), _key("org/c")
    first = deployments.parse("- repo: org/a\n  pin: true\n- repo: org/b\n")
    applied = deployments.apply(redis_client, first)
    assert applied.added == ["org/a", "org/b"]
    actions.deploy(redis_client, c, pinned=False, replicas=1, dtype=None)  # by hand
    _worker_with(redis_client, "w0", a, b, c)
    again = deployments.apply(redis_client, first, sync=True, celery_app=app)
    assert again.unchanged == ["org/a", "org/b"] and again.evicted == []

    second = deployments.parse("- repo: org/a\n  replicas: 2\n  pin: true\n")
    synced = deployments.apply(redis_client, second, sync=True, celery_app=app)
    assert synced.changed == ["org/a"]
    assert synced.evicted == [("org/b", b, ["w0"])]
    wishes = registry.desired(redis_client)
    assert set(wishes) == {a, c}, "the hand-deployed org/c stays; org/b is forgotten"
    assert wishes[a]["replicas"] == 2 and wishes[c]["source"] == "cli"
    assert _evictions(redis_client, "w0") == [b]


def test_without_sync_nothing_is_evicted(redis_client, app):
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n- repo: org/b\n"))
    applied = deployments.apply(redis_client, deployments.parse("- repo: org/a\n"))
    assert applied.evicted == [] and set(registry.desired(redis_client)) == {_key("org/a"), _key("org/b")}


def test_scale_down_evicts_the_least_recently_used_replicas_now(redis_client, app):
    key = _key("org/a")
    _worker_with(redis_client, "w0", key, last_used=100.0)
    _worker_with(redis_client, "w1", key, last_used=300.0)
    _worker_with(redis_client, "w2", key, last_used=200.0)
    evicted = deployments.scale(redis_client, app, key, 1)
    assert sorted(evicted) == ["w0", "w2"]
    assert _evictions(redis_client, "w0") == [key] and _evictions(redis_client, "w1") == []
    assert registry.desired(redis_client)[key]["replicas"] == 1
    assert deployments.scale(redis_client, app, key, 3) == []
    assert registry.desired(redis_client)[key]["replicas"] == 3
    with pytest.raises(actions.FarmError, match="from 1 to 64"):
        deployments.scale(redis_client, app, key, 0)


def test_up_refuses_a_bad_NDIF_DEPLOYMENTS_before_starting_anything(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_")}
    env.update(NDIF_HOME=str(tmp_path / "home"), NDIF_DEPLOYMENTS="[{repo: org/a, replicas: -1}]")
    result = subprocess.run([sys.executable, "-m", "ndif_celery.cli", "up", "--detach"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Error: NDIF_DEPLOYMENTS: entry 1 (org/a): field `replicas` must be a whole number" in result.stderr
    assert not (tmp_path / "home" / "run").exists(), "nothing was started"


# --- the plan (dry run), --force, the boot list's own source ---------------------------


def _wishes(client) -> str:
    return json.dumps(registry.desired(client), sort_keys=True)


def test_a_dry_run_plans_every_change_and_makes_none(redis_client, app):
    a, b = _key("org/a"), _key("org/b")
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n- repo: org/b\n"))
    _worker_with(redis_client, "w0", a, b)
    before = _wishes(redis_client)
    plan = deployments.plan(redis_client, deployments.parse("- repo: org/a\n  replicas: 2\n- repo: org/c\n"),
                            sync=True)
    assert plan.added == ["org/c"] and plan.changed == ["org/a"]
    assert plan.differences["org/a"] == "replicas 1 -> 2"
    assert sorted(plan.loads) == [("org/a", 1), ("org/c", 1)]
    assert plan.evicted == [("org/b", b, ["w0"])]
    assert _wishes(redis_client) == before and _evictions(redis_client, "w0") == [], "nothing changed"


def test_sync_refuses_to_evict_a_pinned_model_or_everything_without_force(redis_client, app):
    a, b = _key("org/a"), _key("org/b")
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n  pin: true\n- repo: org/b\n"))
    _worker_with(redis_client, "w0", a, b)
    before = _wishes(redis_client)
    with pytest.raises(DeploymentsError, match=r"--sync would evict pinned org/a; nothing was changed. Give --force"):
        deployments.apply(redis_client, deployments.parse("- repo: org/b\n"), sync=True, celery_app=app)
    with pytest.raises(DeploymentsError, match="--sync would evict pinned org/a"):
        deployments.apply(redis_client, [], sync=True, celery_app=app)
    assert _wishes(redis_client) == before and _evictions(redis_client, "w0") == [], "nothing changed"
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n- repo: org/b\n"))  # unpinned
    with pytest.raises(DeploymentsError, match="an empty file would evict every model it deployed"):
        deployments.apply(redis_client, [], sync=True, celery_app=app)
    assert set(registry.desired(redis_client)) == {a, b}
    forced = deployments.apply(redis_client, [], sync=True, celery_app=app, force=True)
    assert sorted(forced.evicted) == [("org/a", a, ["w0"]), ("org/b", b, ["w0"])]
    assert registry.desired(redis_client) == {} and sorted(_evictions(redis_client, "w0")) == sorted([a, b])


def test_a_files_sync_leaves_the_boot_lists_wishes_alone(redis_client, app):
    boot = _key("org/boot")
    deployments.apply(redis_client, deployments.parse("- repo: org/boot\n"), source=deployments.BOOT)
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n"))
    synced = deployments.apply(redis_client, deployments.parse("- repo: org/b\n"), sync=True, celery_app=app)
    assert [repo for repo, _, _ in synced.evicted] == ["org/a"]
    assert registry.desired(redis_client)[boot]["source"] == "boot"


# --- wanted vs running, export -------------------------------------------------------


def test_export_writes_a_file_that_deploy_f_takes_back_unchanged(redis_client, app):
    from ndif_celery.farm import wanted

    text = ("- repo: org/a\n  pin: true\n  replicas: 2\n  dtype: bfloat16\n  users: [ada@example.org, 'key:3']\n"
            "- repo: org/b\n  revision: v1\n  task: token-classification\n- repo: org/b\n  dtype: int4\n")
    deployments.apply(redis_client, deployments.parse(text))
    actions.deploy(redis_client, _key("org/c"), pinned=False, replicas=3, dtype=None)
    pipeline = 'nnsight.modeling.diffusion.DiffusionModel:{"repo_id": "org/sd", "revision": null}'
    actions.deploy(redis_client, pipeline, pinned=False, replicas=1, dtype=None)
    assert wanted.export(redis_client)[1] == ["org/sd: its model class or options cannot be written in a "
                                              "deployments file"]
    redis_client.hdel(registry.DESIRED, pipeline)
    exported, skipped = wanted.export(redis_client)
    assert skipped == []
    entries = deployments.parse(exported)
    assert sorted((e.repo, e.dtype or "") for e in entries) == [("org/a", "bfloat16"), ("org/b", ""),
                                                                ("org/b", "nf4"), ("org/c", "")]
    before = {k: {**w, "source": None} for k, w in registry.desired(redis_client).items()}
    again = deployments.apply(redis_client, entries, sync=True, celery_app=app)
    assert again.added == [] and again.evicted == []
    after = {k: {**w, "source": None} for k, w in registry.desired(redis_client).items()}
    assert after == before, "the same wishes, now all the file's"
    assert wanted.export(redis_client)[0] == exported


def test_wanted_rows_say_source_target_running_and_why_not(redis_client, app):
    from ndif_celery.farm import schedules, wanted

    a, b, c, d = _key("org/a"), _key("org/b"), _key("org/c"), _key("org/d")
    deployments.apply(redis_client, deployments.parse("- repo: org/a\n"))
    deployments.apply(redis_client, deployments.parse("- repo: org/b\n  replicas: 2\n"), source=deployments.BOOT)
    _worker_with(redis_client, "w0", a, b, c)  # org/c: loaded by a request, no wish
    redis_client.hset(registry.UNMET, b, json.dumps({"reason": "no live worker can take another replica of it",
                                                     "failed": False, "at": 5.0}))
    schedules.add(redis_client, d, "org/d", time.time() + 3600, time.time() + 7200)
    rows = {row["model"]: row for row in wanted.rows(redis_client)}
    assert (rows["org/a"]["source"], rows["org/a"]["target"], rows["org/a"]["running"], rows["org/a"]["state"]) == \
        ("file", 1, ["w0"], "met")
    assert (rows["org/b"]["source"], rows["org/b"]["target"], rows["org/b"]["state"]) == ("boot", 2, "unmet")
    assert rows["org/b"]["reason"] == "no live worker can take another replica of it"
    assert (rows["org/c"]["source"], rows["org/c"]["target"], rows["org/c"]["state"]) == ("request", None, "met")
    assert (rows["org/d"]["source"], rows["org/d"]["state"]) == ("schedule", "scheduled")
    # A worker launched for org/b (ndif_celery.farm.elastic), not joined yet: "why not" says so.
    from ndif_celery.state import launches

    launches.write(redis_client, {"id": "812", "launcher": "slurm", "state": "PENDING", "reason": "Resources",
                                  "model_key": b, "nnsight": "", "submitted_at": time.time()})
    assert {row["model"]: row for row in wanted.rows(redis_client)}["org/b"]["reason"] == (
        "no live worker can take another replica of it; a worker is being launched: slurm job 812 is pending "
        "(Resources)")


# --- a wish whose load failed ------------------------------------------------------------


def test_a_failed_load_is_not_retried_on_that_worker_and_fails_the_wish_with_its_reason(redis_client, app,
                                                                                        embedded_settings):
    from ndif_celery.farm.controller import Controller

    key = _key("org/broken")
    redis_client.hset(registry.SIZES, f"{key}|", 1000)  # sized: the hub is not asked
    registry.register_worker(redis_client, {"name": "w0", "pid": 1, "memory_bytes": 1 << 30,
                                            "last_seen": time.time()})
    actions.deploy(redis_client, key, pinned=False, replicas=1, dtype=None)
    registry.record_load_failure(redis_client, "w0", key, "Could not load model 'org/broken': bad weights")
    controller = Controller("w0", redis_client, app, embedded_settings)
    controller.tick()
    why = registry.unmet(redis_client)[key]
    assert why["failed"] and why["reason"] == \
        "Could not deploy org/broken: it failed to load on w0: Could not load model 'org/broken': bad weights"
    assert redis_client.llen(worker_queue("w0")) == 0, "not sent to w0 again"
    with pytest.raises(actions.FarmError, match="org/broken: Could not deploy org/broken: it failed to load on w0"):
        actions.wait_running(redis_client, key, 1, timeout=5)
    # A second worker joins: the wish goes to it; the reason goes.
    registry.register_worker(redis_client, {"name": "w1", "pid": 2, "memory_bytes": 1 << 30,
                                            "last_seen": time.time()})
    controller.tick()
    assert redis_client.llen(worker_queue("w1")) == 1 and key not in registry.unmet(redis_client)
    # Deployed again by hand: the failure is forgotten, w0 may try again.
    actions.deploy(redis_client, key, pinned=False, replicas=1, dtype=None)
    assert registry.load_failures(redis_client) == {}
