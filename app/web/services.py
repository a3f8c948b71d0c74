"""The one accessor through which routes reach the engine's service (kept in ``app.extensions``)."""
from __future__ import annotations

from flask import current_app

from app import EXTENSION_KEY
from app.engine.service import Service


def current_service() -> Service:
    """The service of the app handling this request."""
    return current_app.extensions[EXTENSION_KEY]
