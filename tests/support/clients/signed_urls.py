"""Checking the result store's download URLs from outside the store's code.

``sigv4_ok`` recomputes a presigned S3 GET URL's signature independently of
the minio SDK (moto does not verify presigned signatures).
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qsl, quote, urlsplit


def url_query(url: str) -> dict:
    """A URL's query parameters."""
    return dict(parse_qsl(urlsplit(url).query))


def sigv4_ok(url: str, secret_key: str, region: str) -> bool:
    """Check a presigned GET URL's SigV4 signature against the host it names.

    moto does not verify presigned signatures, so this recomputes one
    independently of the minio SDK: it proves the URL was signed for the
    host in it rather than signed for one host and rewritten to another.
    """
    parts = urlsplit(url)
    params = parse_qsl(parts.query, keep_blank_values=True)
    given = dict(params)["X-Amz-Signature"]
    canonical_query = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
        for k, v in sorted(params)
        if k != "X-Amz-Signature"
    )
    canonical_request = "\n".join([
        "GET", parts.path, canonical_query, f"host:{parts.netloc}", "", "host", "UNSIGNED-PAYLOAD",
    ])
    amz_date = dict(params)["X-Amz-Date"]
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    string_to_sign = "\n".join([
        "AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest(),
    ])
    key = ("AWS4" + secret_key).encode()
    for part in (amz_date[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    expected = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, given)
