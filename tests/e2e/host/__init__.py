"""End to end: the CLI on one host: up/down/status, doctor, supervision, the Procfile under honcho."""
