"""``/hub``: a cached model's config and tokenizer files in the hub's shapes, never its weights.

A client with no hub access sets ``HF_ENDPOINT=<farm>/hub``; these tests hold
the routes (``web/model_files.py``) to what huggingface_hub reads: model_info's
id, sha and siblings, a file's ``X-Repo-Commit``/``ETag``/``Content-Length``,
the hub's ``X-Error-Code`` on a refusal. The cache here is laid out as the hub
lays one out (snapshots linking into blobs), with weights, a link out of the
cache and a file over the size bound beside the metadata files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import pytest

from ndif_celery.accounts import db
from ndif_celery.policy import model_policy
from ndif_celery.state import registry

REPO = "org/tiny"
COMMIT = "a" * 40
OTHER_COMMIT = "b" * 40
CONFIG = json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}).encode()
METADATA = {"config.json": CONFIG, "tokenizer.json": b'{"version": "1.0"}', "tokenizer_config.json": b"{}",
            "generation_config.json": b"{}", "additional_chat_templates/tool.jinja": b"{{ messages }}"}
WEIGHTS = {"model.safetensors": b"W" * 64, "pytorch_model.bin": b"B" * 64, "model.gguf": b"G" * 64,
           "flax_model.msgpack": b"M" * 64, "model.onnx": b"O" * 64, "tf_model.h5": b"H" * 64}
CAP = 4096


def _blob(repo_dir, data: bytes) -> str:
    """Store ``data`` as the hub's cache does (blobs/<sha256>); its name."""
    name = hashlib.sha256(data).hexdigest()
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs" / name).write_bytes(data)
    return name


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A hub cache: ``org/tiny`` at ``main`` (linked into blobs, weights too), and an
    older commit with plain files; a link out of the cache; a tokenizer over the bound."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo_dir = root / "models--org--tiny"
    snap = repo_dir / "snapshots" / COMMIT
    (snap / "additional_chat_templates").mkdir(parents=True)
    for name, data in {**METADATA, **WEIGHTS}.items():
        target = os.path.relpath(repo_dir / "blobs" / _blob(repo_dir, data), (snap / name).parent)
        (snap / name).symlink_to(target)
    secret = root.parent / "secret.txt"
    secret.write_text("not yours")
    (snap / "vocab.json").symlink_to(secret)  # an allowed name that leads out of the cache
    (snap / "tokenizer.model").write_bytes(b"T" * (CAP + 1))  # over the bound
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    (repo_dir / "refs" / "v1").write_text(OTHER_COMMIT)
    old = repo_dir / "snapshots" / OTHER_COMMIT
    old.mkdir()
    (old / "config.json").write_bytes(CONFIG)
    return root


@pytest.fixture(scope="module")
def keys(embedded_settings, tmp_path_factory):
    """A key database; its engine."""
    url = f"sqlite:///{tmp_path_factory.mktemp('keys') / 'keys.db'}"
    return url, db.engine_for(url)


def _app(embedded_settings, **changes):
    from web.app import create_app

    settings = dataclasses.replace(embedded_settings, model_file_max_bytes=CAP, **changes)
    return create_app(settings).test_client()


@pytest.fixture
def web(embedded_settings, cache, monkeypatch, redis_client):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return _app(embedded_settings)


def test_model_info_lists_only_the_metadata_files_with_the_cached_commit(web):
    info = web.get(f"/hub/api/models/{REPO}").get_json()
    assert info["id"] == info["modelId"] == REPO and info["sha"] == COMMIT
    assert info["pipeline_tag"] == "text-generation"
    assert [s["rfilename"] for s in info["siblings"]] == sorted(METADATA)  # no weights, no link out, nothing too big
    at_tag = web.get(f"/hub/api/models/{REPO}/revision/v1").get_json()
    assert at_tag["sha"] == OTHER_COMMIT and [s["rfilename"] for s in at_tag["siblings"]] == ["config.json"]
    assert web.get(f"/hub/api/models/{REPO}/revision/{OTHER_COMMIT}").get_json()["sha"] == OTHER_COMMIT


def test_model_info_reads_as_huggingface_hub_reads_it(web):
    from huggingface_hub.hf_api import ModelInfo

    info = ModelInfo(**web.get(f"/hub/api/models/{REPO}").get_json())
    assert info.id == REPO and info.sha == COMMIT and info.pipeline_tag == "text-generation"
    assert {s.rfilename for s in info.siblings} == set(METADATA)


def test_a_file_comes_with_the_headers_huggingface_hub_reads(web):
    for method in (web.head, web.get):
        answer = method(f"/hub/{REPO}/resolve/main/config.json")
        assert answer.status_code == 200
        assert answer.headers["X-Repo-Commit"] == COMMIT
        assert answer.headers["ETag"].strip('"') == hashlib.sha256(CONFIG).hexdigest()  # the blob's name, as the hub's
        assert int(answer.headers["Content-Length"]) == len(CONFIG)
    assert web.get(f"/hub/{REPO}/resolve/main/config.json").data == CONFIG
    assert web.get(f"/hub/{REPO}/resolve/{COMMIT}/additional_chat_templates/tool.jinja").data == b"{{ messages }}"
    old = web.get(f"/hub/{REPO}/resolve/v1/config.json")  # a plain file: git's sha1 of it
    assert old.headers["X-Repo-Commit"] == OTHER_COMMIT
    assert old.headers["ETag"].strip('"') == hashlib.sha1(b"blob %d\0" % len(CONFIG) + CONFIG).hexdigest()


def test_the_tree_lists_the_served_files(web):
    tree = web.get(f"/hub/api/models/{REPO}/tree/main?recursive=true").get_json()
    assert {e["path"] for e in tree if e["type"] == "file"} == set(METADATA)
    flat = web.get(f"/hub/api/models/{REPO}/tree/main").get_json()
    assert {e["path"] for e in flat} == {n for n in METADATA if "/" not in n} | {"additional_chat_templates"}
    inside = web.get(f"/hub/api/models/{REPO}/tree/main/additional_chat_templates").get_json()
    assert [e["path"] for e in inside] == ["additional_chat_templates/tool.jinja"]


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_no_weight_file_is_ever_served(web, name):
    for method in (web.head, web.get):
        answer = method(f"/hub/{REPO}/resolve/main/{name}")
        assert answer.status_code == 404 and answer.headers["X-Error-Code"] == "EntryNotFound"
        assert b"W" * 64 not in answer.data and b"B" * 64 not in answer.data
    assert "never weights" in web.get(f"/hub/{REPO}/resolve/main/{name}").get_json()["detail"]


def test_a_link_out_of_the_cache_and_a_file_over_the_bound_are_not_served(web):
    out = web.get(f"/hub/{REPO}/resolve/main/vocab.json")
    assert out.status_code == 404 and b"not yours" not in out.data
    big = web.get(f"/hub/{REPO}/resolve/main/tokenizer.model")
    assert big.status_code == 413 and "NDIF_MODEL_FILE_MAX_MB" in big.get_json()["detail"]
    missing = web.head(f"/hub/{REPO}/resolve/main/special_tokens_map.json")  # absent: the hub's "not found"
    assert missing.status_code == 404 and missing.headers["X-Error-Code"] == "EntryNotFound"


@pytest.mark.parametrize("path, status", [
    (f"/hub/{REPO}/resolve/main/../../refs/main", 400),
    (f"/hub/{REPO}/resolve/main/..%2F..%2F..%2Fsecret.txt", 400),
    (f"/hub/{REPO}/resolve/main/.hidden.json", 400),
    (f"/hub/{REPO}/resolve/main/config.json%00.txt", 400),
    (f"/hub/{REPO}/resolve/..%2F..%2F/config.json", 400),
    (f"/hub/{REPO}/resolve/main/", 404),
    ("/hub/..%2F..%2Fetc/passwd/resolve/main/config.json", 404),
    ("/hub/org--x/tiny/resolve/main/config.json", 400),
    ("/hub/api/models/../../secret", 404),
    ("/hub/api/models/org/tiny/revision/main..x", 400),
    ("/hub/api/models/org/tiny/revision/nope", 404),
    ("/hub/api/models/org/absent", 404),
    ("/hub/api/models/org/tiny/refs", 404),
    ("/hub/api/models/org/tiny/tree/main/secret", 404),
])
def test_odd_paths_are_refused_and_never_read(web, path, status):
    answer = web.get(path)
    assert answer.status_code == status, answer.get_json()
    assert answer.get_json()["detail"] and answer.headers["X-Error-Message"]
    assert b"not yours" not in answer.data


def test_a_revision_or_repo_not_cached_says_so_in_the_hubs_words(web):
    assert web.get(f"/hub/api/models/{REPO}/revision/nope").headers["X-Error-Code"] == "RevisionNotFound"
    assert web.get("/hub/api/models/org/absent").headers["X-Error-Code"] == "RepoNotFound"
    assert web.get(f"/hub/{REPO}/resolve/{'c' * 40}/config.json").headers["X-Error-Code"] == "RevisionNotFound"


def test_a_repo_outside_ndif_models_is_403(embedded_settings, cache, monkeypatch, redis_client):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    web = _app(embedded_settings, models="org/other,meta-llama/*")
    for path in (f"/hub/api/models/{REPO}", f"/hub/{REPO}/resolve/main/config.json"):
        answer = web.get(path)
        assert answer.status_code == 403 and "NDIF_MODELS" in answer.get_json()["detail"]
        assert "NDIF_MODELS" in answer.headers["X-Error-Message"]
        assert answer.headers["X-Error-Code"] == "GatedRepo"  # huggingface_hub raises it, transformers shows the sentence
    assert _app(embedded_settings, models="org/*").get(f"/hub/api/models/{REPO}").status_code == 200


def test_off_serves_nothing(embedded_settings, cache, monkeypatch, redis_client):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    answer = _app(embedded_settings, model_files=False).get(f"/hub/{REPO}/resolve/main/config.json")
    assert answer.status_code == 404 and "NDIF_MODEL_FILES" in answer.get_json()["detail"]


@pytest.fixture
def auth_web(embedded_settings, cache, keys, monkeypatch, redis_client):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return _app(embedded_settings, auth=True, database_url=keys[0], auth_cache_s=0.0)


def test_with_auth_on_a_key_is_needed_from_hf_token_or_the_header(auth_web, keys):
    for path in (f"/hub/api/models/{REPO}", f"/hub/{REPO}/resolve/main/config.json"):
        missing = auth_web.get(path)
        assert missing.status_code == 401 and "HF_TOKEN" in missing.get_json()["detail"]
        assert "HF_TOKEN" in auth_web.head(path).headers["X-Error-Message"]
    unknown = auth_web.get(f"/hub/api/models/{REPO}", headers={"Authorization": f"Bearer {'1' * 8}-1111-1111-1111-{'1' * 12}"})
    assert unknown.status_code == 403 and "HF_TOKEN" in unknown.get_json()["detail"]
    key = db.create_key(keys[1], "hub-reader@example.org", tags=("trusted",))
    assert auth_web.get(f"/hub/api/models/{REPO}", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert auth_web.get(f"/hub/{REPO}/resolve/main/config.json", headers={"ndif-api-key": key}).data == CONFIG


def test_an_untrusted_key_reads_only_a_deployed_or_listed_repo(embedded_settings, cache, keys, monkeypatch,
                                                             redis_client):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    web = _app(embedded_settings, auth=True, database_url=keys[0], auth_cache_s=0.0)
    key = db.create_key(keys[1], "untrusted-reader@example.org")
    refused = web.get(f"/hub/api/models/{REPO}", headers={"ndif-api-key": key})
    assert refused.status_code == 403 and "not deployed" in refused.get_json()["detail"]
    listed = _app(embedded_settings, auth=True, database_url=keys[0], auth_cache_s=0.0, models="org/*")
    assert listed.get(f"/hub/api/models/{REPO}", headers={"ndif-api-key": key}).status_code == 200


def test_a_deployment_for_named_users_hides_its_files_from_other_keys(auth_web, keys, redis_client):
    canonical = model_policy.ModelKey(model_policy.TRANSFORMERS_MODEL, REPO, None, "text-generation").key
    redis_client.hset(registry.DESIRED, canonical, json.dumps({"users": ["owner@example.org"]}))
    owner = db.create_key(keys[1], "owner@example.org", tags=("trusted",))
    other = db.create_key(keys[1], "not-owner@example.org", tags=("trusted",))
    assert auth_web.get(f"/hub/api/models/{REPO}", headers={"ndif-api-key": owner}).status_code == 200
    refused = auth_web.get(f"/hub/{REPO}/resolve/main/config.json", headers={"ndif-api-key": other})
    assert refused.status_code == 403 and "named users" in refused.get_json()["detail"]


def test_one_address_downloads_a_bounded_number_of_files_at_once(embedded_settings, cache, monkeypatch,
                                                                  redis_client):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    web = _app(embedded_settings, model_files_per_address=1)
    first = web.get(f"/hub/{REPO}/resolve/main/config.json", buffered=False)  # held open: not yet sent
    second = web.get(f"/hub/{REPO}/resolve/main/tokenizer.json")
    assert second.status_code == 429 and "NDIF_MODEL_FILES_PER_ADDRESS" in second.get_json()["detail"]
    assert web.head(f"/hub/{REPO}/resolve/main/tokenizer.json").status_code == 200  # a HEAD sends no file
    first.close()
    assert web.get(f"/hub/{REPO}/resolve/main/tokenizer.json").status_code == 200
