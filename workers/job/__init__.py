"""workers.job."""
