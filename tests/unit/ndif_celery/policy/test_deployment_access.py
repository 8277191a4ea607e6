"""Who may use a deployment (``ndif_celery/policy/deployment_access.py``), with no Redis.

The pure rule: which keys a deployment's ``users`` admit, and which names of
the same weights a key left out is refused. ``farm.deployments.check_access``
reads the wishes and refs from a real Redis in
tests/inprocess/ndif_celery/farm/test_deployments.py.
"""

from __future__ import annotations

import json

import pytest

from ndif_celery.accounts import auth
from ndif_celery.errors import Refused
from ndif_celery.policy import deployment_access, model_policy

ADA = auth.Identity(key_id=3, email="ada@example.org", tags=("trusted",))
BOB = auth.Identity(key_id=4, email="bob@example.org", tags=())


def _key(repo: str, revision=None) -> str:
    return f"{model_policy.TRANSFORMERS_MODEL}:" + json.dumps(
        {"repo_id": repo, "revision": revision, "task": "text-generation"})


def test_users_match_emails_keys_and_tags_and_admin_keys_always():
    ops = auth.Identity(key_id=5, email="ops@example.org", tags=("admin",))
    anonymous = auth.Identity()
    assert deployment_access.may_use([], BOB) and deployment_access.may_use([], anonymous)
    assert deployment_access.may_use(["ada@example.org"], ADA)
    assert not deployment_access.may_use(["ada@example.org"], BOB)
    assert deployment_access.may_use(["key:4"], BOB) and not deployment_access.may_use(["key:4"], ADA)
    assert deployment_access.may_use(["tag:trusted"], ADA) and not deployment_access.may_use(["tag:trusted"], BOB)
    assert deployment_access.may_use(["ada@example.org"], ops)
    assert not deployment_access.may_use(["ada@example.org"], anonymous)


def test_only_the_repos_wishes_that_leave_the_key_out_are_closed_to_it():
    desired = {_key("org/a"): {"users": ["ada@example.org"]}, _key("org/a", "v2"): {},
               _key("org/b"): {"users": ["ada@example.org"]}}
    assert [k.key for k in deployment_access.closed_to(BOB, desired, "org/a")] == [_key("org/a")]
    assert deployment_access.closed_to(ADA, desired, "org/a") == []


def test_a_name_that_may_be_the_closed_weights_is_refused_and_a_known_other_commit_is_not():
    sha, other_sha = "a" * 40, "b" * 40
    closed = deployment_access.closed_to(BOB, {_key("org/a", sha): {"users": ["ada@example.org"]}}, "org/a")
    refs = {"main": sha, "v2": other_sha}
    for revision in (None, "main", sha, "never-recorded"):
        with pytest.raises(Refused, match="for named users only") as refused:
            deployment_access.check(model_policy.parse(_key("org/a", revision)), closed, refs)
        assert refused.value.status == 403
    for revision in ("v2", other_sha):
        deployment_access.check(model_policy.parse(_key("org/a", revision)), closed, refs)
