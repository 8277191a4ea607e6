"""workers.models."""
