"""End to end: the S3 result store against a real (moto) S3 server."""
