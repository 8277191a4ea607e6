"""The 0.6/0.7 clients' wire, written without torch: frames that torch.load
reads as torch would have written them, statuses those clients know, the
headers' envelope. The real 0.6.3 and 0.7.0 clients parse these frames in
tests/e2e/clients/test_other_client_versions.py."""

from __future__ import annotations

import io
import sys

import pytest

from ndif_celery import socketio_wire, wire


def test_a_frame_is_what_torch_load_reads():
    import torch

    frame = socketio_wire.frame("job1", wire.QUEUED, "Waiting (position 2).", data=("https://x/y", 12),
                                session_id="sid")
    loaded = torch.load(io.BytesIO(frame), weights_only=True)
    assert loaded == {"id": "job1", "status": "QUEUED", "description": "Waiting (position 2).",
                      "data": ("https://x/y", 12), "session_id": "sid"}
    assert torch.load(io.BytesIO(frame), weights_only=False) == loaded


def test_the_module_needs_no_torch():
    import subprocess

    code = "import sys; import ndif_celery.socketio_wire; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_statuses_those_clients_do_not_know_are_said_as_ones_they_do():
    assert socketio_wire.status(wire.DEPLOYING) == "QUEUED"
    assert socketio_wire.status("PROVISIONING") == "QUEUED"
    assert [socketio_wire.status(s) for s in ("RECEIVED", "RUNNING", "COMPLETED", "ERROR", "LOG")] == [
        "RECEIVED", "RUNNING", "COMPLETED", "ERROR", "LOG"]
    with pytest.raises(ValueError, match="no 0.6/0.7 status for 'NEW'"):
        socketio_wire.status("NEW")


def test_the_envelope_is_read_from_the_headers():
    key = 'nnsight.modeling.language.LanguageModel:{"repo_id": "org/a", "revision": null}'
    read = socketio_wire.envelope({"nnsight-model-key": key, "nnsight-compress": "True", socketio_wire.SESSION_AS_READ: "s1"})
    assert read == wire.Envelope(model_key=key, compress=True, session_id="s1")
    assert socketio_wire.envelope({"nnsight-model-key": key}).compress is False
    with pytest.raises(ValueError, match="Missing header 'nnsight-model-key'"):
        socketio_wire.envelope({})
    with pytest.raises(ValueError, match="must be True or False, got 'yes'"):
        socketio_wire.envelope({"nnsight-model-key": key, "nnsight-compress": "yes"})


def test_a_session_id_that_is_no_socket_id_is_refused():
    key = 'nnsight.modeling.language.LanguageModel:{"repo_id": "org/a", "revision": null}'
    with pytest.raises(wire.WireError, match="must be the id of this farm's Socket.IO socket"):
        socketio_wire.envelope({"nnsight-model-key": key, socketio_wire.SESSION_AS_READ: "ndif:queue:x"})
    with pytest.raises(wire.WireError, match="Unknown model class"):
        socketio_wire.envelope({"nnsight-model-key": 'os.system:{"repo_id": "org/a"}'})


def test_a_05_envelope_reads_nnsight_zlib_and_not_the_06_header():
    key = 'nnsight.modeling.language.LanguageModel:{"repo_id": "org/a", "revision": null}'
    read = socketio_wire.envelope({"nnsight-model-key": key, "nnsight-zlib": "True"}, wire.ZLIB)
    assert read.compress is True and read.codec == wire.ZLIB
    # A 0.5 client's header means nothing to a 0.6 envelope, and the other way round.
    assert socketio_wire.envelope({"nnsight-model-key": key, "nnsight-zlib": "True"}).compress is False
    assert socketio_wire.envelope({"nnsight-model-key": key, "nnsight-compress": "True"}, wire.ZLIB).compress is False
    with pytest.raises(wire.WireError, match="Header 'nnsight-zlib' must be True or False, got 'yes'"):
        socketio_wire.envelope({"nnsight-model-key": key, "nnsight-zlib": "yes"}, wire.ZLIB)
