"""The wire contract of the nnsight 0.8.1 client, without torch.

The web process validates what the client sends and builds the JSON status
frames it expects; it must never import torch, so nothing here does (nnsight's
own ``schema.response`` imports torch, hence these small twins). Only the worker
builds the binary (pickled) COMPLETED frame, in ``workers.results``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import Refused

RECEIVED = "RECEIVED"
QUEUED = "QUEUED"
DEPLOYING = "DEPLOYING"
RUNNING = "RUNNING"
COMPLETED = "COMPLETED"
ERROR = "ERROR"
LOG = "LOG"
# The client's enum is closed: any other value fails its validation.
STATUSES = frozenset(
    {RECEIVED, QUEUED, "PROVISIONING", DEPLOYING, "DISPATCHED", RUNNING, COMPLETED, ERROR, LOG}
)
TERMINAL = frozenset({COMPLETED, ERROR})

RECEIVED_DESCRIPTION = "Your job has been received and is waiting to be queued."

# "<import.path.ClassName>:<suffix>"; we only build models from nnsight's own
# classes, since importing an arbitrary module named by a client is code execution.
_MODEL_KEY = re.compile(r"^(?P<cls>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+):(?P<suffix>.+)$", re.S)
ALLOWED_MODEL_CLASS_PREFIX = "nnsight.modeling."
MAX_MODEL_KEY_CHARS = 4096
JOB_ID = re.compile(r"^[0-9a-f]{32}$")
#: How a compressed payload is compressed: zstd (0.6 and later) or zlib (0.5).
ZSTD, ZLIB = "zstd", "zlib"


class WireError(Refused, ValueError):
    """A request the client got wrong: 422 unless said otherwise (``errors.Refused``)."""

    status = 422


@dataclass
class Envelope:
    """The JSON routing envelope (``RequestModel.metadata()`` on the client)."""

    model_key: str
    session_id: str = ""
    compress: bool = False
    env: dict = field(default_factory=dict)
    codec: str = ZSTD


def parse_envelope(raw: Optional[str]) -> Envelope:
    """Validate the ``data`` form field, naming exactly what is wrong."""
    if raw is None:
        raise WireError("Missing form field 'data' (the JSON request envelope).")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise WireError(f"Form field 'data' is not valid JSON: {error}.") from None
    if not isinstance(data, dict):
        raise WireError("Form field 'data' must be a JSON object.")
    model_key = data.get("model_key")
    if not isinstance(model_key, str) or not model_key:
        raise WireError("The request envelope needs 'model_key' (a non-empty string).")
    session_id = data.get("session_id", "")
    if not isinstance(session_id, str) or (session_id and not JOB_ID.match(session_id)):
        raise WireError("'session_id' must be the id the /subscribe websocket handed out, or empty.")
    compress = data.get("compress", False)
    if not isinstance(compress, bool):
        raise WireError("'compress' must be true or false.")
    env = data.get("env", {})
    if env is None:
        env = {}
    if not isinstance(env, dict):
        raise WireError("'env' must be a JSON object.")
    check_model_key(model_key)
    return Envelope(model_key=model_key, session_id=session_id, compress=compress, env=env)


def check_model_key(model_key: str) -> None:
    if len(model_key) > MAX_MODEL_KEY_CHARS:
        raise WireError(f"model_key is too long ({len(model_key)} characters; at most {MAX_MODEL_KEY_CHARS}).")
    match = _MODEL_KEY.match(model_key)
    if not match:
        raise WireError(
            f"Malformed model_key {model_key[:200]!r}: expected '<module.Class>:<checkpoint>', "
            "as nnsight's model.to_model_key() builds it."
        )
    if not match.group("cls").startswith(ALLOWED_MODEL_CLASS_PREFIX):
        raise WireError(
            f"Unknown model class {match.group('cls')!r} in model_key: "
            f"this server only builds {ALLOWED_MODEL_CLASS_PREFIX}* models."
        )


def repo_fields(model_key: str) -> dict:
    """``repo_id``, ``revision`` and ``task`` as nnsight.status() reads them."""
    _, _, suffix = model_key.partition(":")
    try:
        data = json.loads(suffix)
    except json.JSONDecodeError:
        return {"repo_id": suffix, "revision": None}
    if not isinstance(data, dict):
        return {"repo_id": suffix, "revision": None}
    fields = {"repo_id": data.get("repo_id", suffix), "revision": data.get("revision")}
    if "task" in data:
        fields["task"] = data["task"]
    if data.get("trust_remote_code"):
        fields["trust_remote_code"] = True
    if data.get("nnsight"):
        fields["nnsight"] = data["nnsight"]  # a runtime's deployment (policy.model_policy.RUNTIME_FIELD)
    return fields


def repo_id(model_key: str) -> str:
    """The repo id a person reads for ``model_key`` (status lines, the dashboard,
    the CLI, the ledger). Lenient on purpose: a display name for any key that
    reached a queue, where ``policy.model_policy.parse`` is the strict check at intake."""
    return str(repo_fields(model_key)["repo_id"])


def response_json(
    job_id: str,
    status: str,
    description: str = "",
    data: Any = None,
    meta: Optional[dict] = None,
) -> str:
    """One status frame, exactly the fields of the client's ``ResponseModel``."""
    if status not in STATUSES:
        raise ValueError(f"{status!r} is not a status the nnsight client accepts")
    return json.dumps(
        {"id": job_id, "status": status, "description": description, "data": data, "meta": meta}
    )


def frame_status(message: bytes) -> str:
    """The status of a published frame: JSON text, or a pickled (zip) COMPLETED."""
    if message[:1] == b"{":
        try:
            return json.loads(message).get("status", "")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return ""
    return COMPLETED
