"""End-to-end tier: every test here starts (or shares) a real stack or server process and is marked ``e2e``."""
