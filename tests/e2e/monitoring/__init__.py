"""End to end: /metrics, the dashboard and its admin forms in a real browser."""
