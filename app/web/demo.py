"""The demo page at ``/``: a person picks or drops photos and sees each one's top classes (app/web/demo/).

Plain HTML, CSS and JavaScript served from the package: no CDN, no build step, works offline. The page holds no
data, so it needs no API key; its calls to /predict and /v1/models carry the key the person types in.
"""
from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

PAGE_DIR = Path(__file__).resolve().parent / "demo"
PAGE_PATH, ASSETS_PATH = "/", "/demo"


def demo_blueprint() -> Blueprint:
    """``/`` (the page) and ``/demo/<file>`` (its script and style)."""
    blueprint = Blueprint("demo", __name__, static_folder=str(PAGE_DIR), static_url_path=ASSETS_PATH)

    @blueprint.get(PAGE_PATH)
    def page() -> Response:
        """The demo page."""
        response = send_from_directory(PAGE_DIR, "index.html", mimetype="text/html")
        response.headers["Cache-Control"] = "no-cache"
        return response

    return blueprint
