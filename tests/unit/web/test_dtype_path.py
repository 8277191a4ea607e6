"""``/dtype/<name>/...`` (``web/dtype_path.py``): the prefix a client puts in its host URL
to ask for a quantized deployment, stripped before any route sees the path."""

from __future__ import annotations

from web import dtype_path


def served(path: str) -> dict:
    seen = {}

    def app(environ, start_response):
        seen.update(path=environ["PATH_INFO"], script=environ.get("SCRIPT_NAME", ""),
                    held=environ.get(dtype_path.ENVIRON_KEY))
        return [b""]

    dtype_path.wrap(app)({"PATH_INFO": path, "SCRIPT_NAME": ""}, lambda *a: None)
    return seen


def test_the_prefix_is_stripped_and_its_name_kept_for_the_intake():
    assert served("/dtype/nf4/request") == {"path": "/request", "script": "/dtype/nf4", "held": "nf4"}
    assert served("/dtype/int8/ws/socket.io/") == {"path": "/ws/socket.io/", "script": "/dtype/int8", "held": "int8"}
    assert served("/dtype/nf4") == {"path": "", "script": "/dtype/nf4", "held": "nf4"}


def test_other_paths_pass_untouched():
    assert served("/request") == {"path": "/request", "script": "", "held": None}
    assert served("/dtypes/nf4/request")["held"] is None
    assert served("/dtype//request") == {"path": "/dtype//request", "script": "", "held": None}
    assert served("/dtype/" + "x" * 41 + "/request")["held"] is None  # no format is that long: a 404 as any path
