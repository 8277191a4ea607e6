"""Model metadata for clients that cannot reach the Hugging Face hub.

Building nnsight's meta model asks the hub for a repo's ``model_info`` and its
config and tokenizer files. On an air-gapped cluster a researcher sets
``HF_ENDPOINT=<farm>/hub`` (and ``HF_TOKEN`` to their NDIF key when auth is on)
and huggingface_hub asks these routes instead, which answer in the hub's own
shapes from this host's Hugging Face cache (the workers' on one host):

* ``GET /hub/api/models/<repo>[/revision/<rev>]``: the repo's id, the cached
  commit, and only the files served here (``siblings``);
* ``HEAD|GET /hub/<repo>/resolve/<rev>/<file>``: one file, with the headers
  huggingface_hub reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``).

Only configuration, tokenizer and processor files, by name (:func:`served`),
each at most NDIF_MODEL_FILE_MAX_MB; never weights, never a path outside the
repo's cache folder. The key and the model policy are the API's: a repo this
key could not run gets 403. Refusals carry the hub's ``X-Error-Code`` and
``X-Error-Message`` headers, so huggingface_hub raises its usual errors (a
missing optional file is "not found", as on the hub) and shows our sentence.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Optional

from flask import Blueprint, Response, current_app, jsonify, request, send_file
from werkzeug.wsgi import ClosingIterator

from ndif_celery.accounts import auth
from ndif_celery.errors import Refused
from ndif_celery.farm import deployments
from ndif_celery.policy import model_policy
from ndif_celery.state import registry

from .identity import client_network

bp = Blueprint("model_files", __name__, url_prefix="/hub")

#: Files served by exact name: what transformers reads to build a config, tokenizer or processor.
SERVED_NAMES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "tekken.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "feature_extractor_config.json", "image_processor_config.json",
    "chat_template.json", "chat_template.jinja", "adapter_config.json",
})
#: The one folder served: chat templates (``*.jinja``), which transformers lists and reads with a tokenizer.
TEMPLATES_DIR = "additional_chat_templates"
#: Never served, whatever the name around it: weights and other checkpoints.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx",
                   ".onnx_data", ".tflite", ".ot", ".npz", ".pkl", ".pickle", ".mlmodel", ".engine")
_FILE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
HEADER_COMMIT = "X-Repo-Commit"
#: The hub's code for "this repo is not yours to read": huggingface_hub raises GatedRepoError, and transformers
#: shows its message (another 403 it would take for a connection error and hide our sentence).
GATED = "GatedRepo"


class NotServed(Refused):
    """A refusal in the hub's words: ``code`` is its ``X-Error-Code`` (RepoNotFound,
    RevisionNotFound, EntryNotFound), which huggingface_hub maps to its error types."""

    def __init__(self, detail: str, status: int, code: str = "") -> None:
        super().__init__(detail, status)
        self.code = code


def served(filename: str) -> bool:
    """Whether ``filename`` (a path inside a repo) is one of the metadata files served here."""
    parts = filename.split("/")
    if not all(_FILE_PART.match(part) for part in parts) or filename.lower().endswith(WEIGHT_SUFFIXES):
        return False
    if len(parts) == 1:
        return parts[0] in SERVED_NAMES
    return len(parts) == 2 and parts[0] == TEMPLATES_DIR and parts[1].endswith(".jinja")


def hub_cache() -> Path:
    """The Hugging Face cache huggingface_hub uses with this process's environment
    (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
    read without importing it: the web imports no model library."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


class Reads:
    """Files this web process is sending, counted per client address (a share, as uploads)."""

    def __init__(self) -> None:
        self.by_address: Counter = Counter()
        self.lock = threading.Lock()

    def take(self, address: str, limit: int) -> None:
        with self.lock:
            if limit and self.by_address[address] >= limit:
                raise NotServed(f"Too many model files at once from your address: at most {limit} per web process "
                                "(NDIF_MODEL_FILES_PER_ADDRESS). Retry when they have arrived.", 429)
            self.by_address[address] += 1

    def give(self, address: str) -> None:
        with self.lock:
            self.by_address[address] -= 1
            if self.by_address[address] <= 0:
                del self.by_address[address]


def _reads() -> Reads:
    """This app's (one per web process) downloads in flight."""
    return current_app.extensions.setdefault("ndif_model_file_reads", Reads())


def _settings():
    return current_app.config["NDIF_SETTINGS"]


def _identity() -> auth.Identity:
    """The caller's key: the ``ndif-api-key`` header, or the bearer token
    huggingface_hub sends from ``HF_TOKEN``."""
    key = request.headers.get(auth.HEADER)
    if not key:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else None
    try:
        return current_app.config["NDIF_AUTH"].identify(key or None, request.remote_addr)
    except auth.AuthError as error:
        if error.status == 401:
            raise NotServed("Missing API key: this farm serves model files to its keys only. Set HF_TOKEN to your "
                            "NDIF API key (huggingface_hub sends it as 'Authorization: Bearer'), or send it in the "
                            "ndif-api-key header.", 401) from None
        raise NotServed(f"{error.detail} (the key is read from HF_TOKEN or the ndif-api-key header)",
                        error.status, GATED if error.status == 403 else "") from None


def check_repo(repo_id: str, revision: Optional[str], identity: auth.Identity) -> None:
    """The repo id is a hub id, and this key could run it: NDIF_MODELS lists
    it (when set), an untrusted key's repo is deployed or listed, and no
    deployment of it for named users leaves this key out."""
    try:
        model_policy.check_repo_id(repo_id, "repo_id")
        if revision is not None:
            model_policy.check_revision(revision)
    except model_policy.PolicyError as error:
        raise NotServed(error.detail, 400) from None
    policy = model_policy.ModelPolicy.from_settings(_settings())
    listed = model_policy.matches(repo_id, policy.models)
    if policy.models and not listed:
        raise NotServed(f"Model {repo_id!r} is not served here (this farm's NDIF_MODELS does not list it), "
                        "so neither are its files.", 403, GATED)
    client = current_app.config["NDIF_REDIS"]
    offer = registry.offer(client, repo_id)
    if not identity.trusted and not listed and not model_policy.keys_of_repo(offer.keys, repo_id):
        raise NotServed(f"Model {repo_id!r} is not deployed on this farm, and untrusted keys cannot deploy new "
                        "models, so its files are not served to this key. Use a model listed in /status.", 403, GATED)
    key = model_policy.ModelKey(model_policy.TRANSFORMERS_MODEL, repo_id,
                                None if revision in (None, model_policy.DEFAULT_BRANCH) else revision,
                                model_policy.LANGUAGE_MODEL_TASK)
    try:
        deployments.check_access(client, identity, key.key, offer)
    except Refused as error:
        raise NotServed(error.detail, 403, GATED) from None


def snapshot(repo_id: str, revision: str) -> tuple[str, Path]:
    """``(commit, snapshot folder)`` of ``repo_id`` at ``revision`` in the cache."""
    repo_dir = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    if not repo_dir.is_dir():
        raise NotServed(f"Model {repo_id!r} is not in this farm's model cache: ask the operator to download it "
                        "(ndif-celery deploy, or huggingface-cli download on the farm).", 404, "RepoNotFound")
    commit = revision
    if not _COMMIT.match(revision):
        try:
            commit = (repo_dir / "refs" / revision).read_text()[:64].strip()
        except OSError:
            commit = ""
    folder = repo_dir / "snapshots" / commit
    if not _COMMIT.match(commit) or not folder.is_dir():
        raise NotServed(f"Revision {revision!r} of {repo_id!r} is not in this farm's model cache.", 404,
                        "RevisionNotFound")
    return commit, folder


def _inside(path: Path, repo_dir: Path) -> Optional[Path]:
    """``path`` with its links followed, if it is a regular file inside ``repo_dir`` (its
    snapshots link into its blobs); None for anything else."""
    real = Path(os.path.realpath(path))
    root = os.path.realpath(repo_dir)
    if os.path.commonpath([str(real), root]) != root or not real.is_file():
        return None
    return real


def listing(folder: Path, under: str = "", recursive: bool = True) -> list[tuple[str, Path]]:
    """The served files of a snapshot (``under`` one of its folders), sorted, as
    ``(path in the repo, real path)``; a file over NDIF_MODEL_FILE_MAX_MB is left out."""
    cap = _settings().model_file_max_bytes
    top = folder / under if under else folder
    names = []
    for path in sorted(top.iterdir()) if top.is_dir() else ():
        name = f"{under}/{path.name}" if under else path.name
        if name == TEMPLATES_DIR and path.is_dir():
            if recursive:
                names.extend(f"{name}/{p.name}" for p in sorted(path.iterdir()))
        else:
            names.append(name)
    out = []
    for name in names:
        real = _inside(folder / name, folder.parent.parent) if served(name) else None
        if real is not None and not (cap and real.stat().st_size > cap):
            out.append((name, real))
    return out


def _pipeline_tag(folder: Path) -> Optional[str]:
    """``text-generation`` for a causal LM (what transformers' ``get_task`` asks of
    ``model_info``); None otherwise (a client then names its task)."""
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    causal = any(isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    return "text-generation" if causal else None


def etag(real: Path, size: int) -> str:
    """The hub's ETag: a blob's name in the cache (the hub's own), else git's sha1 of the file."""
    if real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", real.name):
        return real.name
    return _sha1(str(real), size, real.stat().st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _sha1(real: str, size: int, mtime_ns: int) -> str:
    """git's sha1 of a plain file, once per version of it (a client asks HEAD, then GET)."""
    digest = hashlib.sha1(b"blob %d\0" % size)
    with open(real, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _split(path: str, markers: tuple) -> tuple[str, list[str]]:
    """``org/name/<marker>/...`` or ``name/<marker>/...`` into the repo id and
    the rest from the marker on (a two-part id first, as the hub's ids mostly are)."""
    parts = path.split("/")
    for at in (2, 1):
        if len(parts) > at and parts[at] in markers:
            return "/".join(parts[:at]), parts[at:]
    return "/".join(parts[:2]), parts[2:]


def _revision(parts: list[str]) -> tuple[str, list[str]]:
    """A revision's segments (``refs/pr/N`` is three: huggingface_hub quotes the
    slashes, which arrive decoded) and what follows."""
    if parts and parts[0] == "refs" and len(parts) >= 3:
        return "/".join(parts[:3]), parts[3:]
    return (parts[0], parts[1:]) if parts else ("", [])


@bp.errorhandler(Refused)
def refused(error: Refused):
    """As the API (``{"detail": ...}``), plus what huggingface_hub reads: ``error``
    in the body and ``X-Error-Message`` (a HEAD has no body), ``X-Error-Code``."""
    response = jsonify(detail=error.detail, error=error.detail)
    response.status_code = error.status
    response.headers["X-Error-Message"] = error.detail.encode("ascii", "replace").decode()[:500]
    if getattr(error, "code", ""):
        response.headers["X-Error-Code"] = error.code
    return response


def _enabled() -> None:
    if not _settings().model_files:
        raise NotServed("This farm does not serve model files (NDIF_MODEL_FILES=0): ask its operator.", 404,
                        "RepoNotFound")


@bp.get("/api/models/<path:path>")
def model_info(path: str):
    """The hub's ``model_info`` (the id, the cached commit, the served files) and
    ``list_repo_tree`` (``.../tree/<rev>[/<folder>]``) of the served files."""
    _enabled()
    identity = _identity()
    repo_id, rest = _split(path, ("revision", "tree"))
    if rest and rest[0] in ("revision", "tree"):
        revision, tail = _revision(rest[1:])
        if not revision or (tail and rest[0] == "revision"):
            raise NotServed(f"Not a model_info URL: /hub/api/models/{path[:200]}", 404, "RepoNotFound")
    elif rest:
        raise NotServed(f"This farm answers model_info, tree and files only, not /hub/api/models/{path[:200]}.",
                        404, "EntryNotFound")
    else:
        revision, tail = model_policy.DEFAULT_BRANCH, []
    check_repo(repo_id, revision, identity)
    commit, folder = snapshot(repo_id, revision)
    if rest and rest[0] == "tree":
        return _tree(folder, "/".join(tail), request.args.get("recursive", "").lower() == "true")
    info = {
        "_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "gated": False,
        "disabled": False, "downloads": 0, "likes": 0, "tags": [], "library_name": "transformers",
        "siblings": [{"rfilename": name} for name, _ in listing(folder)],
    }
    tag = _pipeline_tag(folder)
    if tag:
        info["pipeline_tag"] = tag
    return jsonify(info)


def _tree(folder: Path, under: str, recursive: bool):
    """The served files (and the templates folder) of a snapshot, as the hub's tree entries."""
    if under not in ("", TEMPLATES_DIR) or not (folder / under).is_dir():
        raise NotServed(f"No folder {under[:200]!r} served in this repo.", 404, "EntryNotFound")
    entries = []
    if not under and any(name.startswith(TEMPLATES_DIR + "/") for name, _ in listing(folder)):
        entries.append({"type": "directory", "path": TEMPLATES_DIR, "oid": "0" * 40})
    for name, real in listing(folder, under, recursive):
        size = real.stat().st_size
        entries.append({"type": "file", "path": name, "size": size, "oid": etag(real, size)})
    return jsonify(entries)


@bp.route("/<path:path>", methods=["GET", "HEAD"])
def resolve(path: str):
    """One served file of a cached snapshot, with the hub's headers."""
    _enabled()
    identity = _identity()
    repo_id, rest = _split(path, ("resolve",))
    if not rest or rest[0] != "resolve":
        raise NotServed(f"Not a file URL (<repo>/resolve/<revision>/<file>): /hub/{path[:200]}", 404,
                        "RepoNotFound")
    revision, file_parts = _revision(rest[1:])
    filename = "/".join(file_parts)
    if not revision or not filename:
        raise NotServed(f"Not a file URL (<repo>/resolve/<revision>/<file>): /hub/{path[:200]}", 404,
                        "EntryNotFound")
    check_repo(repo_id, revision, identity)
    if not all(_FILE_PART.match(part) for part in file_parts):
        raise NotServed(f"{filename[:200]!r} is not a file name in a repo (letters, digits, '.', '_', '-'; "
                        "no '..').", 400)
    if not served(filename):
        raise NotServed(f"{filename[:200]!r} is not served: this farm serves configuration, tokenizer and processor "
                        "files of its models only, never weights.", 404, "EntryNotFound")
    commit, folder = snapshot(repo_id, revision)
    real = _inside(folder / filename, folder.parent.parent)
    if real is None:
        raise NotServed(f"{repo_id!r} has no {filename!r} at {revision!r} in this farm's model cache.", 404,
                        "EntryNotFound")
    size = real.stat().st_size
    cap = _settings().model_file_max_bytes
    if cap and size > cap:
        raise NotServed(f"{filename!r} of {repo_id!r} is {size} bytes, over this farm's bound on a model file "
                        f"({cap} bytes, NDIF_MODEL_FILE_MAX_MB).", 413)
    headers = {HEADER_COMMIT: commit, "X-Linked-Size": str(size)}
    tag = etag(real, size)
    if request.method == "HEAD":
        response = Response(status=200, headers=headers, mimetype="application/octet-stream")
        response.headers["ETag"] = f'"{tag}"'
        response.headers["Content-Length"] = str(size)
        return response
    address = client_network(request.remote_addr)
    reads = _reads()
    reads.take(address, _settings().model_files_per_address)
    try:
        response = send_file(real, mimetype="application/octet-stream", etag=tag, conditional=True,
                             download_name=Path(filename).name, max_age=0)
    except BaseException:
        reads.give(address)
        raise
    # Given back when the server closes the body: send_file's body is passed through as it is,
    # so the response's own close callbacks would never run.
    response.response = ClosingIterator(response.response, lambda: reads.give(address))
    response.headers.update(headers)
    return response
