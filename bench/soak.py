"""The soak run: mixed requests against one stack for 10 minutes, memory watched.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 4]

One thread cycles through every conformance case (traces, edits, generation,
gradients, sessions, caches; blocking), ``--clients`` threads send traces with
prompts of their own, and one thread sends non-blocking jobs and a job that
raises (which must come back as that ERROR). Every answer is checked against
the same block run locally. The report prints the resident memory (RSS, summed
over each service's processes) of the web and the worker at the start (after
one warm-up round) and at the end, and every error. Exits non-zero on an error
or when memory grew by more than 10 % + 32 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HOME", str(ROOT / "tests" / "_out" / "hf"))
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.load import commit  # noqa: E402
from tests.support.clients.load import block, expected_results, prompt_of  # noqa: E402
from tests.support.clients.remote import poll, slow_job  # noqa: E402
from tests.support.stacks.stack import Stack  # noqa: E402
from tests.support.cases.tiny_model import REPO_ID, build_tiny_gpt2, client_model  # noqa: E402

MiB = 1024 * 1024
PROMPTS_EACH = 20  # each client cycles through this many prompts of its own


def service_rss(leader: int) -> int:
    """Resident bytes of every process in ``leader``'s process group (a
    service runs in a session of its own: gunicorn's workers, isolated children)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != leader:
                continue
            with open(f"/proc/{entry.name}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def failing_job(model) -> None:
    """A block that raises on the server (its frame holds nothing but the model)."""
    with model.trace("this one fails", remote=True):
        hidden = model.transformer.h[0].output
        hidden.save()
        zero = 0
        print(1 / zero)


class Soak:
    def __init__(self, model, cases, local, answers, deadline: float) -> None:
        self.model, self.cases, self.local, self.deadline = model, cases, local, deadline
        self.answers = answers  # (client, request) -> local result of ``block``
        self.errors: list[str] = []
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)

    def conformance(self, tmp: Path) -> None:
        from conformance import case_id, diff

        while time.monotonic() < self.deadline:
            for case in self.cases:
                try:
                    got = case(self.model, lambda m: {"remote": True}, tmp)
                    problem = diff(got, self.local[case])
                except Exception as error:  # noqa: BLE001 - reported, the soak goes on
                    problem = f"{type(error).__name__}: {error}"
                if problem:
                    self.error(f"{case_id(case)}: {problem}")
                self.count("conformance")
                if time.monotonic() >= self.deadline:
                    return

    def client(self, c: int) -> None:
        r = 0
        while time.monotonic() < self.deadline:
            prompt = prompt_of(c, r % PROMPTS_EACH)
            want = self.answers[(c, r % PROMPTS_EACH)]
            try:
                got = block(self.model, prompt, remote=True)
                if not all(a.equal(b) for a, b in zip(got, want)):
                    self.error(f"client {c}: wrong answer for {prompt!r}")
            except Exception as error:  # noqa: BLE001
                self.error(f"client {c}: {type(error).__name__}: {error}")
            self.count("trace")
            r += 1

    def odd_jobs(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                backend = slow_job(self.model, 0, layer=0)
                poll(backend, timeout_s=120)
                self.count("non-blocking")
                try:
                    failing_job(self.model)
                    self.error("a failing block came back COMPLETED")
                except Exception as error:  # noqa: BLE001 - the ERROR is the point
                    if "ZeroDivisionError" not in str(error):
                        self.error(f"failing block: unexpected error {error}")
                self.count("error-raising")
            except Exception as error:  # noqa: BLE001
                self.error(f"non-blocking: {type(error).__name__}: {error}")
            time.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    build_tiny_gpt2(Path(os.environ["HF_HOME"]), REPO_ID)
    import nnsight
    from conformance import CASES

    nnsight.CONFIG.APP.REMOTE_LOGGING = False
    model = client_model()
    tmp = Path(tempfile.mkdtemp(prefix="ndif-soak-"))
    # Local answers first: a local trace is not safe beside remote ones in other threads.
    local = {case: case(model, lambda m: {}, tmp) for case in CASES}
    answers = expected_results(model, args.clients, PROMPTS_EACH)
    with Stack(tmp / "home", env={"HF_HOME": os.environ["HF_HOME"], "HF_HUB_OFFLINE": "1"}) as stack:
        nnsight.CONFIG.API.HOST = stack.url
        for case in CASES:
            case(model, lambda m: {"remote": True}, tmp)
        pids = stack.pids()
        start = {service: service_rss(pids[service]) for service in ("web", "worker")}
        started = time.monotonic()
        soak = Soak(model, CASES, local, answers, started + args.minutes * 60)
        threads = [threading.Thread(target=soak.conformance, args=(tmp,))]
        threads += [threading.Thread(target=soak.client, args=(c,)) for c in range(args.clients)]
        threads.append(threading.Thread(target=soak.odd_jobs))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        end = {service: service_rss(pids[service]) for service in ("web", "worker")}
        elapsed = time.monotonic() - started
    print(f"soak, tiny GPT-2, {elapsed / 60:.1f} min, commit {commit()}")
    print("requests: " + ", ".join(f"{kind} {n}" for kind, n in sorted(soak.counts.items())))
    grew = False
    for service in start:
        limit = start[service] * 1.10 + 32 * MiB
        verdict = "flat" if end[service] <= limit else "GREW"
        grew |= verdict == "GREW"
        print(f"{service:<7} RSS start {start[service] / MiB:8.1f} MiB   end {end[service] / MiB:8.1f} MiB   "
              f"({(end[service] - start[service]) / MiB:+.1f} MiB) {verdict}")
    print(f"errors: {len(soak.errors)}")
    for line in soak.errors[:20]:
        print("  " + line)
    return 1 if soak.errors or grew else 0


if __name__ == "__main__":
    sys.exit(main())
