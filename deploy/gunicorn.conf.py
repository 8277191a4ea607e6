# gunicorn configuration for the ndif-celery web, for operators who run
#   gunicorn -c deploy/gunicorn.conf.py 'web.app:create_app()'
# themselves. The settings live in web/gunicorn_conf.py (read from NDIF_* variables).
from web.gunicorn_conf import *  # noqa: F401,F403
