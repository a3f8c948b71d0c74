"""gunicorn target: ``gunicorn -c gunicorn.conf.py app.wsgi:app``. Loads the model in each worker."""
from app import create_app

app = create_app()
