"""Fast tier: pure functions, parsing and static checks; no Redis, no server process."""
