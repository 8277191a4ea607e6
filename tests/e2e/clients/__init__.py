"""End to end: older nnsight clients side by side, their runtimes, and /hub for offline clients."""
