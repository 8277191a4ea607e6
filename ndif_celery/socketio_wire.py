"""The wire of the nnsight 0.5, 0.6 and 0.7 clients, as far as the web writes and reads it.

Those clients wait on a Socket.IO socket (``web/sio.py``) and read every status
as ``torch.save`` bytes of a plain dict, parsed into their ``ResponseModel``,
whose status enum has no DEPLOYING and no PROVISIONING: an unknown status
crashes the client. They POST a raw body and say what it is in headers. This
module writes those frames without torch (the web never imports it) and reads
those headers; the farm's own clients' wire is ``ndif_celery.wire``. A 0.5
client says ``nnsight-zlib`` where 0.6/0.7 say ``nnsight-compress``: its
payload is zlib, theirs zstd.

A ``torch.save`` file is a zip archive: ``<name>/data.pkl`` (the pickle),
``<name>/byteorder`` and ``<name>/version``. A dict of strings needs no tensor
storage, so the pickle is the plain one and ``torch.load`` reads it as torch
would have written it.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from typing import Any, Mapping, Optional

from . import wire

#: The statuses a 0.6/0.7 client's enum holds (its ``ResponseModel.JobStatus``).
KNOWN = ("RECEIVED", "QUEUED", "DISPATCHED", "RUNNING", "COMPLETED", "LOG", "STREAM", "ERROR")
#: Ours they do not know, as the status they do, the description kept.
SAID_AS = {wire.DEPLOYING: wire.QUEUED, "PROVISIONING": wire.QUEUED}
ARCHIVE = "archive"
PICKLE_PROTOCOL = 2  # what torch.save writes by default

MODEL_KEY, COMPRESS, ZLIB, SESSION = "nnsight-model-key", "nnsight-compress", "nnsight-zlib", "ndif-session_id"
#: ``SESSION`` as gunicorn hands it to the app: a name no client header takes (web/gunicorn_conf.py).
SESSION_AS_READ = "X-Ndif-Socketio-Session"
#: A Socket.IO session id as engine.io makes them (URL-safe base64 of random bytes).
SID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The protocol name a job of these clients carries (``jobs.Job.protocol``).
PROTOCOL = "socketio"


def status(name: str) -> str:
    """One of :data:`KNOWN` for any status of ours."""
    name = SAID_AS.get(name, name)
    if name not in KNOWN:
        raise ValueError(f"no 0.6/0.7 status for {name!r}")
    return name


def frame(job_id: str, status_name: str, description: str = "", data: Any = None,
          session_id: Optional[str] = None) -> bytes:
    """A status as those clients unpickle it: ``torch.save`` bytes of their
    ``ResponseModel`` fields (``data`` only plain Python: a URL, ``(url, size)``)."""
    fields: dict = {"id": job_id, "status": status(status_name), "description": description}
    if data is not None:
        fields["data"] = data
    if session_id is not None:
        fields["session_id"] = session_id
    return torch_save_bytes(fields)


def torch_save_bytes(value: Any) -> bytes:
    """``value`` (no tensors in it) in ``torch.save``'s file format, written without torch."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{ARCHIVE}/data.pkl", pickle.dumps(value, protocol=PICKLE_PROTOCOL))
        archive.writestr(f"{ARCHIVE}/byteorder", "little")
        archive.writestr(f"{ARCHIVE}/version", "3\n")
    return out.getvalue()


def speaks(headers: Mapping[str, str]) -> bool:
    """Whether a ``POST /request`` is in this wire's form: the model key in a header."""
    return bool(headers.get(MODEL_KEY))


def envelope(headers: Mapping[str, str], codec: str = wire.ZSTD) -> wire.Envelope:
    """The headers' envelope, as the farm's own clients' form field gives it;
    what is wrong is named, as there (``wire.WireError``, 422). ``codec`` is
    the client version's (``policy.client_versions.payload_codec``): it says
    which header tells whether the payload is compressed."""
    model_key = (headers.get(MODEL_KEY) or "").strip()
    if not model_key:
        raise wire.WireError(f"Missing header {MODEL_KEY!r} (the model to run the request on).")
    wire.check_model_key(model_key)
    said = ZLIB if codec == wire.ZLIB else COMPRESS
    compress = (headers.get(said) or "False").strip()
    if compress not in ("True", "False"):
        raise wire.WireError(f"Header {said!r} must be True or False, got {compress[:20]!r}.")
    session_id = (headers.get(SESSION_AS_READ) or "").strip()
    if session_id and not SID.fullmatch(session_id):
        raise wire.WireError(f"Header {SESSION!r} must be the id of this farm's Socket.IO socket, or empty.")
    return wire.Envelope(model_key=model_key, session_id=session_id, compress=compress == "True", codec=codec)
