"""Tests through the Flask app factory (tests/conftest.py's ``app`` and ``client``) with tiny fakes, or with the real
model in process: routes, errors, batching, lifecycle, OpenAPI, tracing, metrics, packages."""
