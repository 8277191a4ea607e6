"""The probe's client process (``python -m ndif_celery.monitoring.probe_runner``) keeps
what the client prints out of the beat's log.

The real process, started as the beat starts it (its stderr is the beat's
log, its stdout the protocol), with one part replaced: the trace itself
(``probe_runner.probe``), which needs a farm, is a stand-in that prints what
the nnsight client prints while it waits (a status line rewritten in place
with ``\\r`` and colour escapes, hundreds of times), then fails or answers.
The real client against a real farm, and the beat's real log, are
tests/e2e/farm/test_operations.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ndif_celery.monitoring import probe_runner
from tests.support.paths import ROOT

CHILD = """
import sys
from ndif_celery.monitoring import probe_runner

def probe(cache, model_key):
    for i in range(300):  # the client's spinner, as nnsight's StatusDisplay writes it
        sys.stdout.write(f"\\r\\033[K\\033[2m[job-{model_key}]\\033[0m \\033[1mRUNNING\\033[0m     ({i / 10:.1f}s)")
        sys.stdout.flush()
    print(f"\\r\\033[Kdone waiting for {model_key}", file=sys.stderr)
    if model_key == "fails":
        raise RuntimeError("the farm said no")
    return {"model_key": model_key, "ok": True, "shape": [1, 2, 3], "vocab": 3, "finite": True, "values": [0.0]}

probe_runner.probe = probe
probe_runner.main()
"""


def test_the_clients_output_stays_out_of_the_beats_log_but_a_failures_tail(tmp_path):
    env = dict(os.environ, NDIF_PROBE_HOST="http://127.0.0.1:9", NDIF_PROBE_API_KEY="")
    requests = "".join(json.dumps({"model_key": key, "timeout_s": 60}) + "\n" for key in ("answers", "fails", "answers"))
    done = subprocess.run([sys.executable, "-c", CHILD], input=requests, capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    # The protocol is whole: one JSON line per request, after the ready line.
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert answers[0] == {"ready": True}
    assert [(a["model_key"], a["ok"]) for a in answers[1:]] == [("answers", True), ("fails", False), ("answers", True)]
    assert answers[2]["error"] == "RuntimeError: the farm said no"

    # The beat's log: one line, for the failure, with the client's last lines; no escapes.
    log = done.stderr.splitlines()
    assert len(log) == 1, done.stderr[-3000:]
    [line] = log
    assert line.startswith("probe_runner: the probe of fails failed: RuntimeError: the farm said no; "
                           "the client printed last: "), line
    tail = line.split("the client printed last: ", 1)[1].split(" | ")
    assert len(tail) == probe_runner.TAIL_LINES
    assert tail[-1] == "done waiting for fails" and tail[-2] == "[job-fails] RUNNING     (29.9s)", tail
    assert "\x1b" not in line and "\r" not in line and "job-answers" not in line, "only that probe's output"
    assert len(line) < 200 + probe_runner.TAIL_LINES * (probe_runner.LINE_CHARS + 3)
