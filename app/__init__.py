"""visionserve: image classification over HTTP with dynamic batching. ``create_app`` is the only wiring point.

Imports stay inside ``create_app`` so that importing ``app.config`` (as the gunicorn master does) never loads torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from flask import Flask

    from app.config import Settings
    from app.inference import Predictor


def create_app(settings: "Settings | None" = None, predictor: "Predictor | None" = None) -> "Flask":
    """Build the Flask app: load (or take) the predictor, start the batcher, warm up, register routes."""
    from flask import Flask
    from flask_swagger_ui import get_swaggerui_blueprint

    from app.auth import DOCS_PATH, OPENAPI_PATH
    from app.config import Settings
    from app.errors import register_error_handlers
    from app.inference import Predictor
    from app.logs import configure_logging
    from app.malloc import keep_freed_memory
    from app.routes import bp
    from app.service import EXTENSION_KEY, Service
    from app.v2 import v2_bp

    settings = settings or Settings()
    configure_logging(settings.log_level)
    keep_freed_memory(settings.malloc_trim_threshold_mb)  # before any image buffer is allocated
    if predictor is None:
        predictor = Predictor.load(settings.resolved_weights_dir(), weights_format=settings.weights_format,
                                   device=settings.device, dtype=settings.dtype,
                                   jit_optimize=settings.jit_optimize)
    app = Flask(__name__)
    # werkzeug refuses a larger body with 413 from its Content-Length, before reading it.
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions[EXTENSION_KEY] = Service.build(settings, predictor)
    register_error_handlers(app)
    app.register_blueprint(bp)
    app.register_blueprint(v2_bp)
    # Swagger UI's files ship inside flask-swagger-ui: /docs works offline.
    app.register_blueprint(get_swaggerui_blueprint(DOCS_PATH, OPENAPI_PATH, config={"app_name": "visionserve"}))
    return app
