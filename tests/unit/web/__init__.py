"""Unit tests of web/: what the web app imports."""
