"""``python -m ndif_celery.monitoring.probe_runner``: the health probe's client, in a process of its own.

The beat (``ndif_celery.monitoring.probes``) must not import torch, and the real nnsight
client does (it builds the model's meta graph and serializes the trace), so
the probe's traces run here, in a child the beat starts once and keeps: one
torch import per beat, not one per probe. It is exactly a user's client:
``nnsight.CONFIG.API.HOST`` is the farm's public endpoint (``NDIF_API_URL``,
from ``NDIF_PROBE_HOST``), the key is ``NDIF_PROBE_API_KEY``, and the model is
built from the key the farm deployed (``to_model_key()``, read as the web reads
it, must give it back). A runtime's deployments are probed by this module run
under that runtime's interpreter (its venv sees this package through its
``.pth``): the client is then that nnsight's, a 0.6/0.7 ``LanguageModel``
speaking their protocol, and nothing here needs the farm's own nnsight.

Protocol: one JSON line out when ready (``{"ready": true}``), then for each
JSON line in (``{"model_key", "timeout_s"}``) one JSON line out: ``ok``
(the trace answered), ``latency_s``, ``worker``, ``shape`` and ``vocab`` (the
logits' shape and the config's vocabulary), ``finite``, and ``values``: the
last position's first :data:`VALUES` logits, their mean and standard
deviation over the whole vocabulary, for the beat to compare with the
reference it keeps. A trace with no answer within its timeout is reported and
this process exits (its stuck thread with it); the beat starts another.

The client prints as a user's would: a status line per job (QUEUED, RUNNING,
COMPLETED), a download bar. Copied into the beat's log, that is a few lines
every probe of every model, forever, and it buries what the beat has to say.
So everything this process prints goes to an unnamed file, emptied before
each probe (:class:`Output`); only a failed probe writes to the beat's log:
one line, with the last :data:`TAIL_LINES` lines the client printed.

Only ``ndif_celery.monitoring.probes`` starts it, by module name: nothing imports it, so
the import graph's layers (tools/import_graph.py) are kept.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time

PROMPT = "The health probe of an ndif-celery farm asks"
VALUES = 32
TAIL_LINES = 5  # of the client's output, in the beat's log when a probe fails
TAIL_BYTES = 16384  # read back at most this much of it
LINE_CHARS = 300
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # the status display's colours and line clearing


class Output:
    """Where this process's stdout and stderr go: an unnamed file (fds 1 and 2
    point at it), emptied before each probe, so it holds one probe's output."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile("a+b")  # append: writes follow a truncate
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)

    def clear(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.ftruncate(self.file.fileno(), 0)

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last ``lines`` non-blank lines printed since :meth:`clear`, escapes
        removed, each cut to :data:`LINE_CHARS` (the display rewrites a line with ``\\r``)."""
        sys.stdout.flush()
        sys.stderr.flush()
        size = os.fstat(self.file.fileno()).st_size
        start = max(0, size - TAIL_BYTES)
        text = os.pread(self.file.fileno(), size - start, start).decode("utf-8", "replace")
        kept = [_ESCAPES.sub("", part).strip() for part in re.split(r"[\r\n]", text)]
        return [line[:LINE_CHARS] for line in kept if line][-lines:]


def _model(cache: dict, model_key: str):
    """The client model for ``model_key`` (built once), as a user of this process's
    nnsight would make it: a 0.8 client's TransformersModel, or for a 0.6/0.7
    runtime's deployment their LanguageModel. The key the client sends must be
    read by the farm (as the web reads it) as exactly the deployed one."""
    if model_key in cache:
        return cache[model_key]
    import nnsight
    import nnsight.modeling.huggingface as hf
    from transformers import AutoTokenizer

    from ndif_celery.policy import client_versions
    from ndif_celery.policy import model_policy

    key = model_policy.parse(model_key)
    # The farm's key is canonical already: no hub call to canonicalise the id (offline hosts).
    ids = getattr(hf, "_ID_CACHE", None)
    ids = getattr(hf, "ID_CACHE", {}) if ids is None else ids  # 0.6/0.7 name it without the underscore
    ids[key.repo_id] = key.repo_id
    tokenizer = AutoTokenizer.from_pretrained(key.repo_id, revision=key.revision)
    runtime = client_versions.as_runtime(nnsight.__version__)
    if runtime and client_versions.protocol_of(runtime):
        from nnsight import LanguageModel

        model = LanguageModel(key.repo_id, tokenizer=tokenizer, **({"revision": key.revision} if key.revision else {}))
    else:
        from nnsight.modeling.transformers import TransformersModel

        model = TransformersModel(key.repo_id, revision=key.revision, task=key.task, tokenizer=tokenizer)
    sent = model.to_model_key()
    try:
        read = model_policy.parse_client_key(sent, runtime).key
    except model_policy.PolicyError as error:
        raise RuntimeError(f"the farm refuses the key the client builds, {sent!r}: {error.detail}") from None
    if read != model_key:
        raise RuntimeError(f"the nnsight {nnsight.__version__} client builds {sent!r}, read as {read!r}, "
                           "not the deployed key")
    cache[model_key] = model
    return model


def probe(cache: dict, model_key: str) -> dict:
    import torch

    model = _model(cache, model_key)
    started = time.monotonic()
    with model.trace(PROMPT, remote=True) as tracer:
        logits = model.output.logits.save()
    latency = time.monotonic() - started
    logits = getattr(logits, "value", logits)  # an older client's saved proxy
    logits = logits.detach().to(torch.float64)
    last = logits[0, -1] if logits.dim() == 3 else logits.reshape(-1)
    vocab = getattr(model.config, "vocab_size", None)
    return {
        "model_key": model_key, "ok": True, "latency_s": round(latency, 4),
        "worker": (getattr(tracer.backend, "meta", None) or {}).get("worker"),
        "shape": list(logits.shape), "vocab": vocab,
        "finite": bool(torch.isfinite(logits).all()),
        "values": [*last[:VALUES].tolist(), float(last.mean()), float(last.std())],
    }


_PROTOCOL = None
_LOG = None


def _emit(result: dict) -> None:
    _PROTOCOL.write(json.dumps(result) + "\n")
    _PROTOCOL.flush()


def _report_failure(result: dict, output: Output) -> None:
    """One line in the beat's log for a failed probe: its error and the client's last lines."""
    tail = " | ".join(output.tail())
    _LOG.write(f"probe_runner: the probe of {result.get('model_key')} failed: {result.get('error')}"
               f"{'; the client printed last: ' + tail if tail else ''}\n")
    _LOG.flush()


def main() -> None:
    global _PROTOCOL, _LOG
    # The protocol keeps the real stdout and the beat's log the real stderr;
    # whatever the client prints goes to Output and cannot break a line.
    _PROTOCOL = os.fdopen(os.dup(1), "w")
    _LOG = os.fdopen(os.dup(2), "w")
    output = Output()
    sys.stdout = sys.stderr
    try:
        serve(output)
    except Exception:  # an import that fails, say: the beat's log says why, then the process ends
        import traceback

        _LOG.write(f"probe_runner: stopped: {traceback.format_exc()[-4000:]}"
                   f"probe_runner: the client printed last: {' | '.join(output.tail())}\n")
        _LOG.flush()
        raise


def serve(output: Output) -> None:
    """Answer the beat's requests, one probe at a time, until stdin closes."""
    import nnsight

    nnsight.CONFIG.API.HOST = os.environ["NDIF_PROBE_HOST"]
    nnsight.CONFIG.API.APIKEY = os.environ.get("NDIF_PROBE_API_KEY") or None
    cache: dict = {}
    _emit({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        model_key, timeout_s = request["model_key"], float(request["timeout_s"])
        result: dict = {}

        def run() -> None:
            try:
                result.update(probe(cache, model_key))
            except Exception as error:  # noqa: BLE001 - every failure is a probe result
                text = str(error).strip().splitlines()
                result.update(model_key=model_key, ok=False,
                              error=f"{type(error).__name__}: {text[-1][:300] if text else ''}")

        output.clear()
        started = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            late = {"model_key": model_key, "ok": False, "latency_s": round(time.monotonic() - started, 3),
                    "timed_out": True, "error": f"no answer within {timeout_s:.0f} s (NDIF_PROBE_TIMEOUT_S)"}
            _report_failure(late, output)
            _emit(late)
            os._exit(3)
        result.setdefault("latency_s", round(time.monotonic() - started, 3))
        if not result.get("ok"):
            _report_failure(result, output)
        _emit(result)


if __name__ == "__main__":
    main()
