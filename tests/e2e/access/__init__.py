"""End to end: API keys, auth defaults, which models a key may load, limits, client versions."""
