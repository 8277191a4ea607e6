"""Leftovers of the worker in an isolated child, as attacks.

An untrusted block looks through everything its process holds (every object
the garbage collector knows and every string or bytes reachable from one,
every module's globals, ``os.environ``, ``/proc/self/environ``,
``/proc/self/cmdline``, and its raw writable memory) for the worker's secrets,
other jobs' ids and a signing key to mint result URLs with. Each attack runs
once per isolation mode (``tests/support/cases/jail_fixtures.py``): children of an exec'd
zygote, and children of a zygote forked from the worker's fork server.
"""

from __future__ import annotations

import re
import time

import httpx
import nnsight
import pytest

from tests.support.cases.jail_fixtures import isolation, jail, still_serving_after, worker_pid  # noqa: F401
from tests.support.clients.remote import poll, wait_status
from tests.support.stacks.stack_pool import SECRETS
from tests.support.cases.tiny_model import PROMPT

nnsight.register(__name__)  # the helpers below run inside remote blocks

# A scan's control, reversed: the block makes the string itself, so the scan must find it.
PLANTED = ("planted-" + "marker-" + "0123456789abcdef")[::-1]


def _strings_and_bytes():
    """Every str and bytes an object the garbage collector knows refers to
    (and those inside untracked containers of atomic values), plus every
    module's globals: what ``gc.get_objects()`` hands a block."""
    import gc

    objects = gc.get_objects()
    found = gc.get_referents(*objects)  # one C call for every object's referents
    untracked = [x for x in found if type(x) in (dict, list, tuple, set, frozenset) and not gc.is_tracked(x)]
    found += gc.get_referents(*untracked)
    found += objects  # (every module's globals dict is one of them: its names and values are in ``found``)
    texts = [x for x in found if type(x) is str]
    blobs = [bytes(x[:1 << 20]) for x in found if type(x) in (bytes, bytearray)]
    return texts, blobs


def _writable_memory():
    """(start, end, name) of this process's writable anonymous mappings.

    Read here apart from ``forkserver.scrub_memory``'s alike loop on purpose:
    this is the independent check of which regions the scrub covers, and a
    shared helper would hide a wrong choice from both."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("/")):
            continue
        if len(fields) > 5 and fields[5] in ("[vvar]", "[vsyscall]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        yield start, end, fields[5] if len(fields) > 5 else "anonymous"


def _find_in_memory(reversed_needles):
    """For each needle (given reversed), the writable anonymous mappings of
    this process that hold it. Each mapping is copied into one scratch
    mapping made after the list was taken (so the copies are never scanned)
    and searched with ``mmap.find``; the needle's own bytes do not count."""
    import ctypes
    import mmap
    import sys

    regions = list(_writable_memory())
    needles = {name: bytes(reversed(value.encode())) for name, value in reversed_needles.items()}
    own = {id(needle) + sys.getsizeof(b"") - 1 for needle in needles.values()}  # (two names may share a value)
    scratch = mmap.mmap(-1, max(end - start for start, end, _ in regions))
    base = ctypes.addressof(ctypes.c_char.from_buffer(scratch))
    found = {}
    for start, end, mapping in regions:
        size = end - start
        ctypes.memmove(base, start, size)
        for name, needle in needles.items():
            at = scratch.find(needle, 0, size)
            while at >= 0:
                if start + at not in own:
                    found.setdefault(name, set()).add(f"memory {mapping}")
                    break
                at = scratch.find(needle, at + 1, size)
    del base
    scratch.close()
    return found


def secrets_in_objects(reversed_secrets, plant):
    """Every secret (given reversed, so the block does not carry it) found in
    strings and bytes reachable from any object the garbage collector knows,
    module globals, the environment, /proc/self/environ and cmdline. ``plant``
    (reversed too) is the control: a string this block makes, which must be found."""
    import os

    held = ["".join(reversed(plant))]  # noqa: F841 - the control, in an object gc knows
    texts, blobs = _strings_and_bytes()
    texts.extend(f"{k}={v}" for k, v in os.environ.items())
    for path in ("/proc/self/environ", "/proc/self/cmdline"):
        try:
            blobs.append(open(path, "rb").read())
        except OSError as error:
            texts.append(str(error))
    text = "\0".join(texts)
    blob = b"\0".join(blobs)
    found = {}
    for name, reversed_secret in {**reversed_secrets, "planted": plant}.items():
        secret = reversed_secret[::-1]  # made after the strings were gathered: not among them
        where = set()
        i = text.find(secret)
        if i >= 0:
            where.add("objects: " + text[max(0, i - 80):i + 120].replace(secret, "<SECRET>"))
        if blob.find(secret.encode()) >= 0:
            where.add("bytes, environ or cmdline")
        if where:
            found[name] = sorted(where)
    return {"found": found, "strings": len(texts), "has_worker_settings": "workers.tasks" in __import__("sys").modules}


def secrets_in_memory(reversed_secrets, plant):
    """Every secret (given reversed) found anywhere in this process's writable
    anonymous memory; ``plant`` (reversed) is the control, a string this block
    makes, whose bytes must be found there."""
    held = "".join(reversed(plant))  # noqa: F841 - the control, somewhere in the heap
    return _find_in_memory({**reversed_secrets, "planted": plant})


def _secrets_of(stack) -> dict:
    from ndif_celery import config

    settings = config.load(stack.env)
    secrets = dict(SECRETS)
    secrets["signing key (settings.secret_key)"] = settings.secret_key
    secrets["database URL"] = settings.database_url
    secrets["Redis URL"] = settings.redis_url
    return secrets


def test_no_secret_of_the_worker_anywhere_in_the_childs_memory(jail, model):
    """Objects, strings, module globals, environment, /proc and raw memory:
    no secret value, in either mode (in fork mode the fork server scrubbed
    them before its first zygote; an exec'd zygote never had them). Two jobs,
    each a fresh child of the same zygote: together the scans took 3.5 s
    idle, and past the pooled stacks' timeout (then 6 s) at load."""
    # Reversed here: the block (and the variables it names) must not carry them.
    reversed_secrets = {name: value[::-1] for name, value in _secrets_of(jail).items()}
    with model.trace(PROMPT, remote=True) as tracer:
        outcome = nnsight.save(secrets_in_objects(reversed_secrets, PLANTED))
    assert tracer.backend.meta["isolation"] == isolation(jail)
    assert outcome["strings"] > 10_000, "the block could not even look around"
    found = dict(outcome["found"])
    assert any(w.startswith("objects") for w in found.pop("planted", [])), f"the scan missed the control: {outcome}"
    assert found == {}, f"secrets found in the untrusted job's objects: {found}"
    assert outcome["has_worker_settings"] is False, "the worker's settings module is loaded in the child"

    with model.trace(PROMPT, remote=True) as tracer:
        found = nnsight.save(secrets_in_memory(reversed_secrets, PLANTED))
    found = dict(found)
    assert found.pop("planted", None), f"the memory scan missed the control: {found}"
    assert found == {}, f"secrets found in the untrusted job's memory: {found}"


UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def loot(reversed_job_id):
    """What an attacker's block collects to forge a result URL, from its
    strings: every key-like one (hex keys as ``secrets.token_hex`` makes
    them), and whether another user's job id (given reversed) is among them.
    The values stored under key-like names are :func:`loot_named`'s and raw
    memory :func:`secrets_in_memory`'s, each a job of its own: in one, the
    three ran past a 6 s timeout at load."""
    import re

    texts, _ = _strings_and_bytes()
    hexkey = re.compile(r"[0-9a-f]{64}")
    keys = {t for t in texts if len(t) == 64 and hexkey.fullmatch(t)}
    seen = "\0".join(texts).find(reversed_job_id[::-1]) >= 0  # the id made after the strings were gathered
    return {"keys": sorted(keys)[:5000], "job_id_seen": seen}


def loot_named():
    """Every value stored under a name that says key/secret/sign/token in any
    dict the garbage collector knows (instance and module dicts among them)."""
    import gc
    import re

    named = re.compile(r"secret|sign|key|token|passw", re.I)
    keys = set()
    for obj in gc.get_objects():
        if type(obj) is dict:
            keys.update(v for k, v in obj.items() if type(k) is str and type(v) is str and 8 <= len(v) <= 256
                        and named.search(k))
    return sorted(keys)[:5000]


def test_a_block_cannot_mint_a_url_for_another_users_result(jail, model):
    """User A's job is running, then done with its result in the store.
    /status names no job. User B's block loots its own process for a signing
    key and job ids; every URL minted with what it found is refused by the
    web, and A's job id is not even among what it found."""
    from ndif_celery import config
    from ndif_celery.store import open_store

    with model.trace(PROMPT, remote=True, blocking=False) as tracer:  # non-blocking: through the store
        time.sleep(1.5)
        hidden = model.transformer.h[1].output.save()  # noqa: F841
    backend = tracer.backend
    wait_status(jail.url, backend.job_id, "RUNNING")
    status = httpx.get(f"{jail.url}/status", timeout=10)
    assert backend.job_id not in status.text, "the open /status names a running job"
    assert not UUID.search(status.text), "the open /status names a job"
    assert all("current_job" not in w for w in status.json()["cluster"]["workers"].values())
    poll(backend)
    key = f"results/{backend.job_id}.pt"
    store = open_store(config.load(jail.env))
    assert len(store.get(key)) > 0

    reversed_id = backend.job_id[::-1]
    with model.trace(PROMPT, remote=True):
        found = nnsight.save(loot(reversed_id))
    assert found["job_id_seen"] is False, "another user's job id is in the untrusted job's objects"
    with model.trace(PROMPT, remote=True):
        named = nnsight.save(loot_named())
    assert named, "the block found no value under a key-like name: it could not even look around"
    found["keys"] += named
    with model.trace(PROMPT, remote=True):
        in_memory = nnsight.save(secrets_in_memory({"id": reversed_id}, PLANTED))
    assert dict(in_memory).keys() == {"planted"}, f"another user's job id is in the untrusted job's memory, or the scan missed its control: {in_memory}"
    assert store._secret.decode() not in found["keys"], "the signing key is in the untrusted job's memory"

    expires = int(time.time()) + 600
    minted = [f"{jail.url}/results/{key}?expires={expires}&signature={_sign(candidate, key, expires)}"
              for candidate in found["keys"]]
    # Every candidate, checked as the web checks it; the first ones also over HTTP.
    assert not [c for c in found["keys"] if store.signature_valid(key, expires, _sign(c, key, expires))]
    with httpx.Client(timeout=10) as client:
        for url in minted[:40]:
            assert client.get(url).status_code in (401, 403, 404), url
        # The control: the same scheme with the real key opens A's result,
        # so a leaked key would have been enough.
        real = f"{jail.url}/results/{key}?expires={expires}&signature={_sign(store._secret.decode(), key, expires)}"
        assert client.get(real).status_code == 200


def _sign(secret: str, key: str, expires: int) -> str:
    """ndif_celery/store/__init__.py's scheme: HMAC-SHA256 of ``key\\nexpires``."""
    import hashlib
    import hmac

    return hmac.new(secret.encode(), f"{key}\n{expires}".encode(), hashlib.sha256).hexdigest()


def test_the_fork_servers_derived_secrets_cover_url_passwords():
    """The fork server searches memory for each secret and its derived forms:
    a URL's password (as written and unquoted) and ``user:password``, and
    secret-named environment variables; never what a needed variable holds."""
    from workers.isolation.forkserver import derived_secrets

    needles = derived_secrets(
        ["redis://:p%40ss-word-0123@10.0.0.1:6379/0", "postgresql://ndif:db-pass-4567@db/ndif"],
        {"HF_TOKEN": "hf_abcdefghijklmnop", "HF_HOME": "/srv/hf-cache-dir", "NDIF_HOME": "/srv/hf-cache-dir",
         "NDIF_API_KEY_FILE_PASSWORD": "short"},
        keep=("HF_HOME",),
    )
    for expected in (b"p%40ss-word-0123", b"p@ss-word-0123", b"ndif:db-pass-4567", b"db-pass-4567",
                     b"hf_abcdefghijklmnop", b"redis://:p%40ss-word-0123@10.0.0.1:6379/0"):
        assert expected in needles, expected
    assert b"/srv/hf-cache-dir" not in needles, "a needed value would be scrubbed"
    assert b"short" not in needles


@pytest.fixture(autouse=True)
def _mode_is_as_configured(jail):
    """The jail fixture's two stacks really are the two modes."""
    assert isolation(jail) in ("fork", "zygote")
    yield
