"""Declarative deployments: a file that says which models the farm keeps, and for whom.

``ndif-celery deploy -f models.yaml [--sync]`` and ``NDIF_DEPLOYMENTS`` (a
file path or an inline list, applied by the controller when the farm starts
and again whenever a worker joins) read the same format, YAML or JSON: a list
of entries, or ``{"deployments": [...]}``::

    - repo: openai-community/gpt2
      revision: main          # optional (the hub's default branch)
      task: text-generation   # optional, as the client's default
      nnsight: 0.7.0          # optional: for that runtime's clients (docs/versions.md)
      dtype: bfloat16         # optional (the checkpoint's); nf4, int8, fp4, fp8: a quantized deployment of its own
      replicas: 2             # optional, 1
      pin: true               # optional, false: never evicted for another model
      users: [ada@example.org, "tag:trusted", "key:12"]   # optional: who may use it

Each entry becomes a wish in ``ndif:desired`` (``registry.DESIRED``), the same
the controller keeps true for ``ndif-celery deploy``, marked ``source:
"file"`` (``"boot"`` for NDIF_DEPLOYMENTS). ``--sync`` evicts the wishes a file
put there that the file no longer lists, and nothing else: models deployed by
hand (``ndif-celery deploy MODEL``), by the boot list, loaded on a user's first
request, or pinned by a schedule are not the file's to remove. A sync that
would evict a pinned model, or everything (an empty file), needs ``force``;
:func:`plan` is the dry run. Evicting "every unpinned model" instead would
unload, at every sync, the models researchers are using right now on demand.

``users`` maps "who" onto what the key database knows of a key
(``ndif_celery.accounts.db``, ``ndif_celery.accounts.auth.Identity``): an email (every key of
that user), ``key:<id>`` (one key), or ``tag:<trusted|priority|admin>``. Keys
tagged ``admin`` (operators, and the health probe's key) may always use a
deployment (the rule: ``ndif_celery.policy.deployment_access``). With
``NDIF_AUTH`` off everyone is anonymous, so a deployment with ``users``
refuses every request: ``deploy -f`` says so.

Every file is checked whole before anything is written; an error names the
entry (its position and repo) and the field. Sizes are bounded: a file of at
most :data:`MAX_FILE_BYTES` and :data:`MAX_ENTRIES` entries, at most
:data:`MAX_USERS` users each.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import redis

from ndif_celery.accounts import db
from ndif_celery.celery_app import EVICT_MODEL, worker_queue
from ndif_celery.policy import deployment_access, held_formats, model_policy
from ndif_celery.state import registry

from . import actions

MAX_FILE_BYTES = 1024 * 1024
MAX_ENTRIES = 1000
MAX_USERS = 1000
MAX_REPLICAS = 64
FIELDS = ("repo", "revision", "task", "nnsight", "dtype", "replicas", "pin", "users")
SOURCE = "file"

_EMAIL = re.compile(r"^[^@\s]{1,64}@[^@\s]{1,255}$")


class DeploymentsError(ValueError):
    """A deployments file (or NDIF_DEPLOYMENTS) that cannot be applied; the message says where and why."""


@dataclass(frozen=True)
class Entry:
    """One checked entry: what to keep deployed, and for whom."""

    repo: str
    model_key: str
    revision: Optional[str] = None
    dtype: Optional[str] = None
    replicas: int = 1
    pin: bool = False
    users: tuple = ()

    def wish(self) -> dict:
        """The ``ndif:desired`` value the controller keeps true."""
        wish = {"pinned": self.pin, "replicas": self.replicas, "dtype": self.dtype, "source": SOURCE}
        if self.users:
            wish["users"] = list(self.users)
        return wish


# --- reading and checking ---------------------------------------------------------


def load_file(path: "str | Path", policy: Optional[model_policy.ModelPolicy] = None, where: str = "") -> list[Entry]:
    """The checked entries of the file at ``path`` (``where`` names it in errors; default: the path)."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DeploymentsError(f"{path}: {size} bytes; a deployments file may have at most {MAX_FILE_BYTES}")
        text = path.read_text()
    except OSError as error:
        raise DeploymentsError(f"cannot read the deployments file {path}: {error.strerror or error}") from None
    return parse(text, where or str(path), policy)


def from_setting(value: str, policy: Optional[model_policy.ModelPolicy] = None) -> list[Entry]:
    """``NDIF_DEPLOYMENTS``: an inline list (it starts with ``[`` or ``{``) or a file path; empty: none."""
    value = (value or "").strip()
    if not value:
        return []
    if value[0] in "[{":
        return parse(value, "NDIF_DEPLOYMENTS", policy)
    return load_file(value, policy, where=f"NDIF_DEPLOYMENTS={value}")


def parse(text: str, where: str = "deployments", policy: Optional[model_policy.ModelPolicy] = None) -> list[Entry]:
    """The checked entries of a YAML or JSON document (JSON is YAML); ``where``
    names it in errors. ``policy``: also refuse repos the farm's NDIF_MODELS /
    NDIF_TRUST_REMOTE_CODE refuse."""
    import yaml

    if len(text.encode()) > MAX_FILE_BYTES:
        raise DeploymentsError(f"{where}: over {MAX_FILE_BYTES} bytes")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise DeploymentsError(f"{where}: not valid YAML or JSON{at}: {problem}") from None
    if isinstance(document, dict):
        unknown = sorted(set(map(str, document)) - {"deployments"})
        if unknown:
            raise DeploymentsError(f"{where}: unknown top-level field(s) {', '.join(unknown)}; "
                                   "expected a list of entries or {deployments: [...]}")
        document = document.get("deployments")
    if document is None:
        document = []
    if not isinstance(document, list):
        raise DeploymentsError(f"{where}: expected a list of entries, got {type(document).__name__}")
    if len(document) > MAX_ENTRIES:
        raise DeploymentsError(f"{where}: {len(document)} entries; at most {MAX_ENTRIES}")
    entries, seen = [], {}
    for index, raw in enumerate(document, start=1):
        entry = _entry(raw, f"{where}: entry {index}", policy)
        if entry.model_key in seen:
            raise DeploymentsError(f"{where}: entry {index} ({entry.repo}) repeats entry {seen[entry.model_key]} "
                                   "(the same repo, revision and task)")
        seen[entry.model_key] = index
        entries.append(entry)
    return entries


def _entry(raw: object, where: str, policy: Optional[model_policy.ModelPolicy]) -> Entry:
    if not isinstance(raw, dict):
        raise DeploymentsError(f"{where}: expected a mapping with at least `repo`, got {type(raw).__name__}")
    repo = raw.get("repo")
    if not isinstance(repo, str) or not repo:
        raise DeploymentsError(f"{where}: field `repo` is required (a hub repo id such as openai-community/gpt2)")
    where = f"{where} ({repo[:100]})"
    unknown = sorted(str(k) for k in raw if k not in FIELDS)
    if unknown:
        raise DeploymentsError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    revision = _optional_text(raw, "revision", where)
    task = _optional_text(raw, "task", where) or "text-generation"
    runtime = raw.get("nnsight")
    if runtime is not None and not isinstance(runtime, str):
        raise DeploymentsError(f"{where}: field `nnsight` must be a version in quotes such as \"0.7.0\", "
                               f"got {runtime!r}")
    try:
        model_policy.check_repo_id(repo, "repo")
        dtype = _optional_text(raw, "dtype", where)
        dtype = held_formats.check(dtype) if dtype is not None else None
        key = actions.model_key_for(repo, task=task, revision=revision, nnsight=runtime or "", dtype=dtype)
        if policy is not None:
            policy.check_model(model_policy.parse(key))
    except (model_policy.PolicyError, held_formats.FormatError) as error:
        raise DeploymentsError(f"{where}: {error.detail}") from None
    replicas = raw.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise DeploymentsError(f"{where}: field `replicas` must be a whole number from 1 to {MAX_REPLICAS}, "
                               f"got {replicas!r}")
    pin = raw.get("pin", False)
    if not isinstance(pin, bool):
        raise DeploymentsError(f"{where}: field `pin` must be true or false, got {pin!r}")
    return Entry(repo=repo, model_key=key, revision=revision, dtype=dtype, replicas=replicas, pin=pin,
                 users=check_users(raw.get("users"), where))


def _optional_text(raw: dict, name: str, where: str) -> Optional[str]:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise DeploymentsError(f"{where}: field `{name}` must be a non-empty string, got {value!r}")
    return value


def check_users(value: object, where: str) -> tuple:
    """``users`` as stored: emails (lower-cased), ``key:<id>``, ``tag:<tag>``; empty: everyone."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise DeploymentsError(f"{where}: field `users` must be a list (emails, key:<id>, tag:<tag>), "
                               f"got {type(value).__name__}")
    if len(value) > MAX_USERS:
        raise DeploymentsError(f"{where}: field `users` lists {len(value)}; at most {MAX_USERS}")
    users = []
    for item in value:
        if not isinstance(item, (str, int)) or isinstance(item, bool):
            raise DeploymentsError(f"{where}: field `users`: {item!r} is not an email, key:<id> or tag:<tag>")
        text = str(item).strip()
        kind, _, rest = text.partition(":")
        if kind == "key" and rest.isdigit() and len(rest) <= 18:
            users.append(f"key:{int(rest)}")
        elif kind == "tag" and rest in db.TAGS:
            users.append(text)
        elif kind == "tag":
            raise DeploymentsError(f"{where}: field `users`: unknown tag {rest[:40]!r}; keys carry "
                                   f"{', '.join(db.TAGS)}")
        elif _EMAIL.match(text):
            users.append(text.lower())
        else:
            raise DeploymentsError(f"{where}: field `users`: {text[:100]!r} is not an email, key:<id> or "
                                   "tag:<tag>")
    return tuple(dict.fromkeys(users))


# --- who may use a deployment -------------------------------------------------------


def check_access(client: redis.Redis, identity, model_key: str, offer: Optional[registry.Offer] = None) -> None:
    """At intake: refuse (403) a key that a deployment of the same weights does
    not list in ``users`` (the rule: ``policy.deployment_access``). Reads the
    wishes, and the repo's refs only when a wish of it is closed to the key.
    ``offer``: the farm as the intake read it (with the repo's refs), else read now."""
    key = model_policy.parse(model_key)
    desired = offer.desired if offer is not None else registry.desired(client)
    closed = deployment_access.closed_to(identity, desired, key.repo_id)
    refs: dict = {}
    if closed:
        refs = offer.refs_of(client, key.repo_id) if offer is not None else registry.refs(client, key.repo_id)
    deployment_access.check(key, closed, refs)


# --- applying -----------------------------------------------------------------------


BOOT = "boot"  # the source of NDIF_DEPLOYMENTS's wishes (SOURCE: a file's, ``deploy -f``)


@dataclass
class Applied:
    """What an apply changes (or, as a plan, would change), for the CLI to print."""

    added: list = field(default_factory=list)
    changed: list = field(default_factory=list)
    differences: dict = field(default_factory=dict)  # repo -> what changes: "replicas 1 -> 2, ..."
    unchanged: list = field(default_factory=list)
    evicted: list = field(default_factory=list)  # (repo, model key, [workers]) of the wishes --sync removes
    loads: list = field(default_factory=list)  # (repo, replicas to load): fewer hold it than it wants
    writes: dict = field(default_factory=dict)  # model key -> the wish to write
    pinned_evicted: list = field(default_factory=list)  # repos of pinned wishes --sync removes

    def refusal(self, entries: list) -> Optional[str]:
        """Why ``--sync`` needs ``--force``: it evicts a pinned model, or every wish while listing nothing."""
        if self.pinned_evicted:
            return f"--sync would evict pinned {', '.join(sorted(self.pinned_evicted))}"
        if self.evicted and not entries:
            return "--sync with an empty file would evict every model it deployed"
        return None


def plan(client: redis.Redis, entries: list[Entry], sync: bool = False, source: str = SOURCE) -> Applied:
    """What :func:`apply` would write and evict; nothing is changed."""
    done = Applied()
    wishes = registry.desired(client)
    running: dict[str, list] = {}
    for held in registry.live_deployments(client):
        running.setdefault(held["model_key"], []).append(held["worker"])
    listed = set()
    for entry in entries:
        listed.add(entry.model_key)
        wanted = {**entry.wish(), "source": source}
        old = wishes.get(entry.model_key)
        missing = entry.replicas - len(running.get(entry.model_key, []))
        if missing > 0:
            done.loads.append((entry.repo, missing))
        if old is not None and old.get("schedule"):
            # Pinned by a schedule for now: the schedule restores this when its window ends.
            if old.get("before") != wanted:
                done.writes[entry.model_key] = {**old, "before": wanted, "users": wanted.get("users")}
                done.changed.append(entry.repo)
                done.differences[entry.repo] = _difference(old.get("before") or {}, wanted)
            else:
                done.unchanged.append(entry.repo)
            continue
        if old == wanted:
            done.unchanged.append(entry.repo)
            continue
        if old is None:
            done.added.append(entry.repo)
        else:
            done.changed.append(entry.repo)
            done.differences[entry.repo] = _difference(old, wanted)
        done.writes[entry.model_key] = wanted
    if sync:
        for model_key, wish in wishes.items():
            if model_key in listed or not _from_file(wish):
                continue
            repo = model_policy.parse(model_key).repo_id
            done.evicted.append((repo, model_key, sorted(running.get(model_key, []))))
            if wish.get("pinned") and not wish.get("schedule"):
                done.pinned_evicted.append(repo)
    return done


def apply(client: redis.Redis, entries: list[Entry], sync: bool = False, celery_app=None, source: str = SOURCE,
          force: bool = False) -> Applied:
    """Write each entry's wish (and, with ``sync``, evict the file-made wishes it
    no longer lists: ``celery_app`` sends the evictions); wake the controller.
    A sync that would evict a pinned model, or everything, raises unless ``force``.
    Every listed model's failed loads are forgotten: applying again retries them.

    All or nothing: every refusal is raised before anything is written, and
    the wishes (written, rewritten, removed) change in one Redis transaction;
    only then are the evictions sent, to the workers that hold the removed
    models (a model whose eviction could not be sent is left loaded with no
    wish, as if a request had loaded it)."""
    done = plan(client, entries, sync, source)
    refusal = done.refusal(entries) if sync and not force else None
    if refusal:
        raise DeploymentsError(f"{refusal}; nothing was changed. Give --force to do it.")
    wishes = registry.desired(client)
    evicted, done.evicted = done.evicted, []
    to_send = [model_key for _, model_key, _ in evicted if not wishes[model_key].get("schedule")]
    if to_send and celery_app is None:
        raise ValueError("sync needs the celery app to send evictions")
    pipe = client.pipeline(transaction=True)
    registry.forget_load_failures(client, pipe, [entry.model_key for entry in entries])
    for model_key, wish in done.writes.items():
        pipe.hset(registry.DESIRED, model_key, json.dumps(wish))
    for _, model_key, _ in evicted:
        wish = wishes[model_key]
        if wish.get("schedule"):
            # Pinned by a schedule now: let it go when the window ends, not before.
            pipe.hset(registry.DESIRED, model_key, json.dumps({**wish, "before": None}))
        else:
            actions.forget_wish(client, pipe, model_key)
    pipe.execute()
    for repo, model_key, _ in evicted:
        sent = actions.send_evictions(client, celery_app, model_key) if model_key in to_send else []
        done.evicted.append((repo, model_key, sent))
    registry.wake_controller(client, "deployments")
    return done


def capacity_problems(client: redis.Redis, settings, entries: list[Entry],
                      plan_: Optional[Applied] = None) -> list[str]:
    """Why the live workers cannot meet the file's entries (each alone, then all
    at once), as ``deploy -f`` refuses it before writing anything; [] if they can.
    ``plan_``: the sync's plan, whose evictions free their pinned room."""
    from . import capacity

    wishes = registry.desired(client)
    for _, model_key, _ in (plan_.evicted if plan_ is not None else []):
        wishes.pop(model_key, None)
    needs = [capacity.demand(client, settings, entry.model_key, entry.replicas, entry.dtype) for entry in entries]
    return capacity.problems(needs, capacity.live_views(client, wishes), lambda n: f"set `replicas: {n}`")


def _difference(old: dict, new: dict) -> str:
    """What a wish's rewrite changes, as the plan prints it."""
    names = {"replicas": "replicas", "pinned": "pin", "dtype": "dtype", "users": "users", "source": "source"}
    parts = [f"{name} {old.get(key)!r} -> {new.get(key)!r}".replace("'", "")
             for key, name in names.items() if old.get(key) != new.get(key)]
    return ", ".join(parts) or "rewritten"


def _from_file(wish: dict) -> bool:
    before = wish.get("before") if wish.get("schedule") else None
    return wish.get("source") == SOURCE or (isinstance(before, dict) and before.get("source") == SOURCE)


def warnings(entries: list[Entry], auth: bool) -> list[str]:
    """What an operator should know before relying on ``entries`` on this farm."""
    if auth:
        return []
    return [f"{entry.repo}: `users` has no effect but refusal with NDIF_AUTH off (everyone is anonymous): "
            "every request for it is refused" for entry in entries if entry.users]


def scale(client: redis.Redis, celery_app, model_key: str, replicas: int) -> list[str]:
    """Keep ``replicas`` workers holding the model (a new wish if none yet); the
    replicas beyond it are evicted now, least recently used first. Returns the
    workers told to evict it."""
    if isinstance(replicas, bool) or not 1 <= replicas <= MAX_REPLICAS:
        raise actions.FarmError(f"replicas must be from 1 to {MAX_REPLICAS}, got {replicas}")
    raw = client.hget(registry.DESIRED, model_key)
    wish = json.loads(raw) if raw else {"pinned": False, "dtype": None, "source": "cli"}
    wish["replicas"] = replicas
    if wish.get("schedule") and isinstance(wish.get("before"), dict):
        wish["before"] = {**wish["before"], "replicas": replicas}
    pipe = client.pipeline()
    registry.forget_load_failures(client, pipe, [model_key])
    pipe.hset(registry.DESIRED, model_key, json.dumps(wish))
    pipe.execute()
    holders = sorted(actions.holders(client, model_key), key=_last_activity)
    extra = holders[: max(0, len(holders) - replicas)]
    for holder in extra:
        celery_app.send_task(EVICT_MODEL, kwargs={"model_key": model_key}, queue=worker_queue(holder["worker"]))
    registry.wake_controller(client, "scale")
    return [holder["worker"] for holder in extra]


def _last_activity(holder: dict) -> float:
    return holder.get("last_used") or holder.get("loaded_at") or holder.get("created_at") or 0.0
