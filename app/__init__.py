"""visionserve: image classification over HTTP with dynamic batching. The app is built by ``create_app``
(app/factory.py), the only wiring point.

This package's own module holds constants only, so importing ``app`` or ``app.config`` (as the gunicorn master
does, for ``EXTENSION_KEY`` and the settings) never loads torch or Flask.
"""
from __future__ import annotations

__version__ = "0.1.0"
# Where create_app keeps the service in ``app.extensions``; gunicorn.conf.py finds it there for the SIGTERM drain.
EXTENSION_KEY = "visionserve"
