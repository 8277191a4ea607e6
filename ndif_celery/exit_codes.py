"""Exit statuses that a service and any supervisor agree on.

``up``'s supervisor, systemd units and Compose restart policies all read
these, so they live apart from any one of them.
"""

# A service asks for a fresh copy of itself: restarted at once, no backoff.
# 75 is EX_TEMPFAIL ("try again"), which neither Celery, gunicorn nor Redis
# exits with on its own.
REPLACE_EXIT_CODE = 75

# A setting makes the service unable to run (sysexits' EX_CONFIG): restarting
# it unchanged would fail the same way, so its log says why.
EX_CONFIG = 78
