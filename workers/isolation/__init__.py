"""workers.isolation."""
