"""In-process tests of web/: Flask's test client or a loopback server in this process."""
