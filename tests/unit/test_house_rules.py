"""What the repository may not hold: references to an issue tracker it does
not have, or to files outside it (a development machine's paths, the notes
beside the checkout). History belongs in commits, reasons in the text."""

from __future__ import annotations

import re
import subprocess

from tests.support.paths import ROOT

ISSUE = re.compile(r"\bissues? #\d+|\(#\d+\)|#\d+ item", re.IGNORECASE)
OUTSIDE = re.compile(r"/work/(main|shared)\b|\.\./shared/|\bshared/(cobatch/|[a-z-]+\.md\b)")


def _tracked_text():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        path = ROOT / name
        if path.suffix in (".png", ".jpg", ".ico") or not path.is_file():
            continue
        try:
            yield name, path.read_text()
        except UnicodeDecodeError:
            continue


def test_no_issue_numbers_and_no_paths_outside_the_repository():
    found = []
    for name, text in _tracked_text():
        for number, line in enumerate(text.splitlines(), 1):
            if ISSUE.search(line) or OUTSIDE.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_the_rules_catch_what_they_name():
    hash_ = "#"  # written apart, so this file does not hold what it looks for
    assert ISSUE.search(f"as issue {hash_}15 asked") and ISSUE.search(f"fixed ({hash_}13)")
    assert ISSUE.search(f"{hash_}14 item 4")
    assert not ISSUE.search("port 8001 # the API") and not ISSUE.search("color: #1a2b3c")
    assert OUTSIDE.search("see /work" + "/sha" + "red/cobatch/README.md") and OUTSIDE.search(".." + "/sha" + "red/design.md")
    assert OUTSIDE.search("(see " + "sha" + "red/server-recipe.md)") and not OUTSIDE.search("a shared/ folder")
