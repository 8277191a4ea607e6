"""Real nnsight clients of other versions (0.5.15, 0.6.3 and 0.7.0, each in its own
environment made from the package index) against a farm that serves only its
own nnsight: each is refused with a sentence naming its version and the
versions served, shown by that client, blocking (after its Socket.IO socket
was accepted) and not; ``nnsight.status()`` works from each; and each reads
the status frames the farm writes for it without torch (``socketio_wire``).
A 0.4 client, which no runtime can serve, reads that it is not served and
why."""

from __future__ import annotations

import pytest

from ndif_celery import socketio_wire, wire
from ndif_celery.policy import client_versions
from tests.support.clients import client_envs
from tests.support.cases.tiny_model import PROMPT, REPO_ID

OLD = ("0.5.15", "0.6.3", "0.7.0")

#: These clients ask the hub for the repo's canonical id; the hub is out of reach here, and the id is the repo's.
# 0.5 reads a module-level block's source with inspect: give this -c program's text a file's place.
SOURCE_READABLE = """
import linecache
_SOURCE = sys.orig_argv[sys.orig_argv.index("-c") + 1]
linecache.cache["<string>"] = (len(_SOURCE), None, _SOURCE.splitlines(keepends=True), "<string>")
"""

OFFLINE_REPO_ID = """
import types
import huggingface_hub
huggingface_hub.HfApi.model_info = lambda self, repo_id, *args, **kwargs: types.SimpleNamespace(id=repo_id)
"""

TRACE = """
import json, sys
import nnsight
from nnsight import CONFIG, LanguageModel
CONFIG.API.HOST = sys.argv[1]
""" + SOURCE_READABLE + OFFLINE_REPO_ID + """
model = LanguageModel(sys.argv[2])
try:
    with model.trace(sys.argv[3], remote=True, blocking=sys.argv[4] == "blocking"):
        out = model.transformer.h[0].output.save()
    print(json.dumps({"version": nnsight.__version__, "ran": True}))
except BaseException as error:
    print(json.dumps({"version": nnsight.__version__, "error": type(error).__name__, "said": str(error)}))
"""

STATUS = """
import json, sys
import nnsight
from nnsight import CONFIG
CONFIG.API.HOST = sys.argv[1]
status = getattr(nnsight, "status", None) or nnsight.ndif_status  # 0.5 names it ndif_status
print(json.dumps({"version": nnsight.__version__, "status": status()}, default=str))
"""


FRAMES = """
import json, sys
from nnsight.schema.response import ResponseModel
read = [ResponseModel.unpickle(bytes.fromhex(frame)) for frame in sys.argv[1:]]
print(json.dumps({"read": [[r.id, r.status.name, r.description, r.data, r.session_id] for r in read]}))
"""


@pytest.fixture(scope="module", params=OLD)
def client(request):
    return request.param, client_envs.shared(request.param).interpreter


@pytest.mark.parametrize("mode", ["blocking", "non-blocking"])
def test_a_client_version_the_farm_does_not_serve_reads_why(client, fs_stack, mode):
    version, python = client
    said = client_envs.run(python, TRACE, fs_stack.url, REPO_ID, PROMPT, mode)
    assert said["version"] == version and "ran" not in said, said
    assert said["error"] == "ConnectionError", said
    assert said["said"] == (
        f"This farm does not serve nnsight {version}: a request runs only under the client's own nnsight version, "
        f"and this farm serves nnsight {client_versions.MAIN}. Install one of those "
        f"(`pip install nnsight=={client_versions.MAIN}`), or ask the farm's operator to add {version} "
        f"(`ndif-celery runtime add {version}`).")


def test_nnsight_status_works_from_the_older_client(client, on_fs_stack, model):
    with model.trace(PROMPT, remote=True):  # the farm's own client: the model is deployed
        model.transformer.h[0].output.save()
    version, python = client
    said = client_envs.run(python, STATUS, on_fs_stack.url)
    assert said["version"] == version
    entry = said["status"][REPO_ID]  # these clients key it by repo id
    assert "RUNNING" in str(entry["state"]) and entry["repo_id"] == REPO_ID, said


def test_the_older_client_reads_the_status_frames_the_farm_writes_without_torch(client):
    version, python = client
    frames = [socketio_wire.frame("j1", wire.RECEIVED, wire.RECEIVED_DESCRIPTION, session_id="s1"),
              socketio_wire.frame("j1", wire.DEPLOYING, "Loading org/a onto gpu0."),
              socketio_wire.frame("j1", wire.RUNNING, "Your job has started running."),
              socketio_wire.frame("j1", wire.COMPLETED, "Done.", data=["http://farm/result/j1", 1234])]
    said = client_envs.run(python, FRAMES, *[frame.hex() for frame in frames])["read"]
    assert said == [["j1", "RECEIVED", wire.RECEIVED_DESCRIPTION, None, "s1"],
                    ["j1", "QUEUED", "Loading org/a onto gpu0.", None, None],
                    ["j1", "RUNNING", "Your job has started running.", None, None],
                    ["j1", "COMPLETED", "Done.", ["http://farm/result/j1", 1234], None]], (version, said)


# The 0.4 client configures its host without a scheme and speaks the same Socket.IO first.
TRACE_04 = """
import json, sys
import nnsight
from nnsight import CONFIG, LanguageModel
host = sys.argv[1].removeprefix("http://")
CONFIG.API.HOST, CONFIG.API.SSL = host, False
""" + OFFLINE_REPO_ID + """
model = LanguageModel(sys.argv[2])
try:
    with model.trace(sys.argv[3], remote=True):
        out = model.transformer.h[0].output.save()
    print(json.dumps({"version": nnsight.__version__, "ran": True}))
except BaseException as error:
    print(json.dumps({"version": nnsight.__version__, "error": type(error).__name__, "said": str(error)}))
"""


def test_a_04_client_reads_that_no_runtime_serves_it(fs_stack):
    python = client_envs.client_only("nnsight-0.4.11", ["nnsight==0.4.11"], drop=("torchvision",))
    said = client_envs.run(python, TRACE_04, fs_stack.url, REPO_ID, PROMPT)
    assert said["version"] == "0.4.11" and "ran" not in said, said
    assert said["error"] == "ConnectionError", said
    assert said["said"] == (
        "This farm does not serve nnsight 0.4.11: clients before 0.5.0 send their code as a graph this farm "
        "does not run. Install nnsight 0.5.0 or later (`pip install --upgrade nnsight`).")
