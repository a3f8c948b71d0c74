"""The demo page at ``/``: a person picks or drops photos and sees each one's top classes, and, asked "why?", the
top class's Grad-CAM overlay (app/web/demo/).

Plain HTML, CSS and JavaScript served from the package: no CDN, no build step, works offline. The page holds no
data, so it needs no API key; its calls to /predict, /explain and /v1/models carry the key the person types in.
"""
from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

PAGE_DIR = Path(__file__).resolve().parent / "demo"
PAGE_PATH, ASSETS_PATH, FAVICON_PATH = "/", "/demo", "/favicon.ico"


def demo_blueprint() -> Blueprint:
    """``/`` (the page), ``/demo/<file>`` (its script and style) and ``/favicon.ico`` (the site's icon, an SVG:
    every browser asks for it, on /docs too, and a 404 there is an error in each one's console)."""
    blueprint = Blueprint("demo", __name__, static_folder=str(PAGE_DIR), static_url_path=ASSETS_PATH)

    @blueprint.get(PAGE_PATH)
    def page() -> Response:
        """The demo page."""
        response = send_from_directory(PAGE_DIR, "index.html", mimetype="text/html")
        response.headers["Cache-Control"] = "no-cache"
        return response

    @blueprint.get(FAVICON_PATH)
    def favicon() -> Response:
        """The site's icon."""
        return send_from_directory(PAGE_DIR, "favicon.svg", mimetype="image/svg+xml", max_age=86400)

    return blueprint
