"""Who may use a deployment: the rule the intake and ``/hub`` apply, with no Redis.

A deployment may name its ``users`` (``ndif_celery.farm.deployments`` reads
them from a deployments file). A key outside them is refused the deployment's
weights under any name: another revision, task or alias that may load the
same weights counts as the same. ``farm.deployments.check_access`` reads the
wishes and the repo's refs from Redis, then asks this module.
"""

from __future__ import annotations

from typing import Mapping

from ndif_celery.errors import Refused

from . import model_policy


def may_use(users: "list | tuple", identity) -> bool:
    """Whether ``identity`` (``auth.Identity``) is one of ``users``; an empty list is everyone.
    An ``admin`` key may always: the operators', and the health probe's."""
    if not users or "admin" in identity.tags:
        return True
    for user in users:
        if user.startswith("key:"):
            if identity.key_id is not None and user == f"key:{identity.key_id}":
                return True
        elif user.startswith("tag:"):
            if user[4:] in identity.tags:
                return True
        elif identity.email and user == identity.email.lower():
            return True
    return False


def closed_to(identity, desired: Mapping[str, dict], repo_id: str) -> list[model_policy.ModelKey]:
    """The wished keys of ``repo_id`` (``desired``: model key -> wish) whose ``users`` leave ``identity`` out."""
    restricted = [wished for wished, wish in desired.items()
                  if wish.get("users") and not may_use(wish["users"], identity)]
    return model_policy.keys_of_repo(restricted, repo_id)


def check(key: model_policy.ModelKey, closed: list, refs: Mapping[str, str]) -> None:
    """Refuse (403) ``key`` when one of the ``closed`` keys may name the same
    weights (``refs``: the repo's known revisions): refused rather than guessed."""
    for other in closed:
        if model_policy.may_be_same_weights(key, other, refs):
            raise Refused(f"Model {key.repo_id!r} is deployed on this farm for named users only, and this API key "
                          "is not one of them. Ask the operator to add your email or key to its deployment.", 403)
