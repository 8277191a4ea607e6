"""Every HTML page the web serves refuses to be framed, and no answer is sniffed.

The dashboard's admin forms post as same-origin: a page of another site that
frames the dashboard could make an operator click them. So every HTML page
says ``frame-ancestors 'none'`` (and the older ``X-Frame-Options: DENY``),
and every answer ``nosniff`` and ``Referrer-Policy: same-origin`` (no URL of
this farm goes to another site; ``no-referrer`` would make a browser send
``Origin: null`` on the forms' POSTs, which the admin check refuses). The pages
are found by walking the app's routes, not listed by hand.
"""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture(scope="module", params=[False, True], ids=["auth off", "auth on"])
def web(embedded_settings, request):
    from web.app import create_app

    return create_app(dataclasses.replace(embedded_settings, auth=request.param)).test_client()


def _pages(web) -> list:
    """Every GET route without parameters, and one that is not there."""
    rules = web.application.url_map.iter_rules()
    return sorted({rule.rule for rule in rules if "GET" in rule.methods and not rule.arguments}) + ["/no-such-page"]


def test_every_html_page_refuses_framing_and_sniffing(web, redis_client):
    html = []
    for path in _pages(web):
        answer = web.get(path)
        assert answer.headers.get("X-Content-Type-Options") == "nosniff", path
        assert answer.headers.get("Referrer-Policy") == "same-origin", path
        if answer.mimetype == "text/html":
            html.append(path)
            assert answer.headers.get("X-Frame-Options") == "DENY", path
            assert "frame-ancestors 'none'" in answer.headers.get("Content-Security-Policy", ""), path
    assert "/dashboard" in html, f"no HTML page was found among {_pages(web)}"
