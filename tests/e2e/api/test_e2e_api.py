"""End to end: the real nnsight client against the real stack (gunicorn web,
Celery worker, embedded Redis, filesystem store), beyond the conformance cases:
statuses, LOG lines, meta, user errors, non-blocking use, the /status, /env and
/whoami endpoints, request hygiene and malformed requests.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
import uuid

import httpx
import nnsight
import pytest
import torch
import zstandard
from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

from tests.support.cases import conformance
from tests.support.clients.remote import final_status, poll, same_as_local
from tests.support.cases.tiny_model import REPO_ID, build_tiny_gpt2, client_model

PROMPT = conformance.PROMPT
SECOND_REPO = "ndif-celery/tiny-gpt2-second"


class Recording(RemoteBackend):
    """The real blocking backend, remembering every status it handled."""

    def __init__(self, model) -> None:
        super().__init__(model.to_model_key(), env=model._remoteable_get_env())
        self.seen = []

    def handle(self, response):
        self.seen.append((response.status.value, response.description))
        return super().handle(response)


def test_statuses_in_order_and_first_request_deploys(on_fs_stack, hf_home):
    build_tiny_gpt2(hf_home, repo_id=SECOND_REPO, n_layer=2, seed=1)
    second = client_model(SECOND_REPO)
    backend = Recording(second)
    with second.trace(PROMPT, backend=backend):
        out = second.transformer.h[1].output.save()
        print("hello from the block")
        print("second line")
    statuses = [status for status, _ in backend.seen]
    assert statuses == ["RECEIVED", "QUEUED", "DEPLOYING", "RUNNING", "LOG", "LOG", "COMPLETED"]
    logs = [text for status, text in backend.seen if status == "LOG"]
    assert logs == ["hello from the block", "second line"]
    with second.trace(PROMPT):
        local = second.transformer.h[1].output.save()
    assert torch.equal(out, local)

    # The model is now resident: the next request does not deploy again.
    again = Recording(second)
    with second.trace(PROMPT, backend=again):
        second.transformer.h[0].output.save()
    assert "DEPLOYING" not in [status for status, _ in again.seen]


def test_meta_reports_what_the_job_cost(on_fs_stack, model):
    with model.trace(PROMPT, remote=True) as tracer:
        model.output.logits.save()
    meta = tracer.backend.meta
    assert meta["queue_ms"] >= 0
    assert meta["run_ms"] > 0
    assert meta["result_bytes"] > 0
    assert meta["payload_bytes"] > 0
    assert meta["worker"]


def test_a_result_over_the_inline_limit_goes_through_the_store(on_fs_stack, model):
    """A blocking client's 6 MB result is above NDIF_MAX_INLINE_BYTES (4 MiB):
    it never rides pub/sub (whose buffers would drop the subscriber), it comes
    as a URL and arrives intact."""

    def block(remote):
        with model.trace(PROMPT, remote=remote) as tracer:
            noise = torch.randn(1_500_000, generator=torch.Generator().manual_seed(0))  # incompressible
            big = (model.transformer.h[-1].output[0].sum() + noise).save()
        return big, tracer

    local, _ = block(False)
    remote, tracer = block(True)
    assert local.numel() * 4 > on_fs_stack_inline_limit()
    assert tracer.backend.meta["inline"] is False
    assert tracer.backend.meta["result_bytes"] > on_fs_stack_inline_limit()
    assert torch.equal(remote, local)


def on_fs_stack_inline_limit() -> int:
    from ndif_celery import config

    return config.load({}).max_inline_bytes


def test_user_error_surfaces_with_the_users_own_line(on_fs_stack, model):
    with pytest.raises(RemoteError) as caught:
        with model.trace(PROMPT, remote=True) as tracer:
            hidden = model.transformer.h[0].output
            ratio = hidden.sum() / 0  # noqa: F841
            missing = {}["no-such-key"]  # the user's bug  # noqa: F841
    message = str(caught.value)
    assert "KeyError: 'no-such-key'" in message
    # The block travels as ast.unparse'd source, so quotes are normalised.
    assert "missing = {}['no-such-key']" in message
    assert __file__ in message
    assert "site-packages" not in message and "/workers/" not in message
    assert tracer.backend.meta is not None and "worker" in tracer.backend.meta


def test_nonblocking_submit_then_poll_like_a_user(on_fs_stack, model):
    with model.trace(PROMPT, remote=True, blocking=False) as tracer:
        logits = model.output.logits.save()  # noqa: F841
    backend = tracer.backend
    assert backend.job_id
    result = poll(backend)
    with model.trace(PROMPT):
        local = model.output.logits.save()
    assert torch.equal(result["logits"], local)

    # A freshly built backend that knows only the job id polls the same result.
    fresh = RemoteBackend(model.to_model_key(), blocking=False, job_id=backend.job_id)
    assert torch.equal(poll(fresh)["logits"], local)


def test_status_and_is_model_running(on_fs_stack, model, monkeypatch):
    with model.trace(PROMPT, remote=True):
        model.output.logits.save()
    status = nnsight.status()
    assert REPO_ID in status
    assert status.status.value == "UP"
    entry = status[REPO_ID]
    assert entry["level"] == "HOT" and entry["state"] == "RUNNING" and entry["hot_replicas"] >= 1
    assert entry["task"] == "text-generation"

    raw = nnsight.status(raw=True)
    assert raw["cluster"]["workers"], "the cluster lists its workers"

    # is_model_running canonicalizes the id through the hub, which is unreachable here.
    import huggingface_hub

    monkeypatch.setattr(
        huggingface_hub.HfApi, "model_info", lambda self, repo_id, **_: types.SimpleNamespace(id=repo_id)
    )
    assert nnsight.is_model_running(REPO_ID) is True
    assert nnsight.is_model_running(REPO_ID, task="text-generation") is True
    assert nnsight.is_model_running("nobody/not-deployed") is False


def test_remote_env_and_compare(on_fs_stack):
    from nnsight import ndif

    env = ndif.get_remote_env(force_refresh=True)
    assert env["python_version"].split()[0] == sys.version.split()[0]
    assert env["packages"]["torch"] == torch.__version__
    assert env["packages"]["nnsight"] == "0.8.1"
    comparison = nnsight.compare()
    assert comparison.critical_mismatches == {}
    assert "Python Version:" in str(comparison)


def test_whoami_and_ping(on_fs_stack):
    assert nnsight.whoami() == {"email": None, "tags": []}
    assert httpx.get(f"{on_fs_stack.url}/ping").json() == "pong"


def test_same_trace_site_with_new_code_runs_the_new_code(on_fs_stack, model, tmp_path):
    """nnsight caches compiled blocks by (file, line); the server must not."""
    name = f"site_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    template = (
        "def probe(model, prompt, remote):\n"
        "    with model.trace(prompt, remote=remote):\n"
        "        out = model.transformer.h[{layer}].output.save()\n"
        "    return out\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        results = []
        for layer in (0, 5):
            path.write_text(template.format(layer=layer))
            _forget_client_caches(str(path))
            module = importlib.import_module(name) if layer == 0 else importlib.reload(sys.modules[name])
            remote = module.probe(model, PROMPT, True)
            local = module.probe(model, PROMPT, False)
            assert torch.equal(remote, local)
            results.append(remote)
        assert not torch.equal(results[0], results[1])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def _forget_client_caches(filename: str) -> None:
    # The client caches sources by file name too; a researcher editing a file
    # in a notebook session restarts or reloads; here we clear its caches.
    import linecache

    from nnsight.tracing import globals as g

    g.SOURCES.pop(filename, None)
    for key in [k for k in g.BLOCKS if k[0] == filename]:
        del g.BLOCKS[key]
    linecache.checkcache(filename)


def test_backward_leaves_no_grads_on_the_weights(on_fs_stack, model):
    with model.trace(PROMPT, remote=True):
        hidden = model.transformer.h[0].output
        hidden.requires_grad_(True)
        loss = model.output.logits.sum()
        with loss.backward():
            grad = hidden.grad.save()
    assert torch.isfinite(grad).all()
    with model.trace(PROMPT, remote=True):
        weight_grad_is_none = nnsight.save(model.transformer.h[0].mlp.c_fc.weight.grad is None)
        needs_grad = nnsight.save(model.transformer.h[0].mlp.c_fc.weight.requires_grad)
    assert weight_grad_is_none is True
    assert needs_grad is False


# --- malformed requests: a clear error naming the problem, and the worker keeps serving


def _post(stack, data, blob=b"x", headers=None):
    files = {"blob": ("request", blob, "application/octet-stream")} if blob is not None else None
    form = {"data": data} if data is not None else None
    return httpx.post(f"{stack.url}/request", data=form, files=files, headers=headers, timeout=30)


def _envelope(model, **overrides):
    envelope = {"model_key": model.to_model_key(), "session_id": "", "compress": False, "env": {}}
    envelope.update(overrides)
    return json.dumps(envelope)


@pytest.mark.parametrize(
    "data, blob, status, words",
    [
        ("{not json", b"x", 422, "not valid JSON"),
        (None, b"x", 422, "Missing form field 'data'"),
        ('["a list"]', b"x", 422, "must be a JSON object"),
        ('{"session_id": ""}', b"x", 422, "model_key"),
        ("ENVELOPE", None, 400, "Missing file part 'blob'"),
        ("ENVELOPE", b"", 400, "'blob' part is empty"),
        ("ZSTD", b"definitely not zstd", 400, "not a valid zstd frame"),
        ('{"model_key": "os.system:rm -rf /"}', b"x", 422, "Unknown model class 'os.system'"),
        ('{"model_key": "no colon here"}', b"x", 422, "Malformed model_key"),
    ],
)
def test_malformed_request_is_refused_clearly(on_fs_stack, model, data, blob, status, words):
    if data == "ENVELOPE":
        data = _envelope(model)
    elif data == "ZSTD":
        data = _envelope(model, compress=True)
    response = _post(on_fs_stack, data, blob)
    assert response.status_code == status
    assert words in response.json()["detail"]
    _still_serving(model)


def test_unknown_response_id_is_404_with_detail(on_fs_stack):
    for job_id in (uuid.uuid4().hex, "not-an-id"):
        response = httpx.get(f"{on_fs_stack.url}/response/{job_id}")
        assert response.status_code == 404
        assert job_id in response.json()["detail"]


class Corrupting(RemoteBackend):
    """Sends a payload whose bytes were damaged after serialization."""

    def __init__(self, model) -> None:
        super().__init__(model.to_model_key(), env=model._remoteable_get_env())

    def _serialize(self, tracer):
        blob = super()._serialize(tracer)
        if self.compress:
            # A whole zstd frame (the web checks the header) of half the payload. Not bytes
            # flipped inside the frame: it has no checksum, so flipped literals can decode
            # to a payload that loads and names a module that does not exist (seen once).
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(blob)
            return zstandard.ZstdCompressor().compress(raw[: len(raw) // 2])
        return blob[: len(blob) // 2]


@pytest.mark.parametrize("compress", [True, False], ids=["zstd", "raw"])
def test_corrupt_payload_is_an_error_and_the_worker_keeps_serving(on_fs_stack, model, compress, monkeypatch):
    monkeypatch.setattr(nnsight.CONFIG.API, "COMPRESS", compress)
    with pytest.raises(RemoteError, match="Your request payload could not be read"):
        with model.trace(PROMPT, backend=Corrupting(model)):
            model.output.logits.save()
    _still_serving(model)


def test_unknown_model_is_an_error_naming_it(on_fs_stack, model):
    key = model.to_model_key().replace(REPO_ID, "nobody/no-such-model")
    response = _post(on_fs_stack, json.dumps({"model_key": key}), b"payload")
    assert response.status_code == 200
    latest = final_status(on_fs_stack.url, response.json()["id"])
    assert latest["status"] == "ERROR"
    assert "Could not load model 'nobody/no-such-model'" in latest["description"]
    _still_serving(model)


def _still_serving(model) -> None:
    same_as_local(model)


def test_compressed_result_is_one_zstd_frame_with_content_size(on_fs_stack, model, monkeypatch):
    """The client's one-shot decompress needs the frame's content size."""
    monkeypatch.setattr(nnsight.CONFIG.API, "COMPRESS", True)
    seen = {}
    original = RemoteBackend.finalize

    def spy(self, content):
        seen["params"] = zstandard.get_frame_parameters(content)
        return original(self, content)

    monkeypatch.setattr(RemoteBackend, "finalize", spy)
    with model.trace(PROMPT, remote=True):
        model.output.logits.save()
    assert seen["params"].content_size > 0


def test_trusted_weight_edits_do_not_reach_the_next_job(on_fs_stack, model):
    """In-process (trusted) jobs run on the resident model itself: edits in
    place, through .data, and a replaced .data apply to their own run only;
    the worker notices after answering and reloads before the next job."""
    with model.trace(PROMPT, remote=True) as tracer:
        model.transformer.h[0].mlp.c_fc.weight[:] = 0
        model.transformer.h[1].mlp.c_proj.weight.data.zero_()
        model.transformer.ln_f.weight.data = torch.zeros_like(model.transformer.ln_f.weight)
        edited = model.transformer.h[-1].output.save()
    assert tracer.backend.meta["isolated"] is False
    with model.trace(PROMPT):
        clean = model.transformer.h[-1].output.save()
    assert not torch.equal(edited, clean), "the edit did not even apply to its own run"
    with model.trace(PROMPT, remote=True):
        after = model.transformer.h[-1].output.save()
    assert torch.equal(after, clean)
    log = (on_fs_stack.logs_dir / "worker.log").read_text()
    assert f"job {tracer.backend.meta['job_id']} changed 3 weight tensors; model reloaded" in log
