"""The unit of the serving budget (issue #50): a bare Flask app with one route that reads the posted body and answers
a small JSON, served by gunicorn with visionserve's worker class. Its CPU per request, measured with the same client
in the same run, is "one bare-Flask request".

    python -m gunicorn -c /dev/null -k app.hosting.worker.BufferingWorker --threads 8 -w 2 -b 127.0.0.1:8001 \
        bench.serving.bare_app:app
"""
from __future__ import annotations

from flask import Flask, jsonify, request

app = Flask(__name__)


@app.post("/predict")
def predict():  # noqa: ANN201 - the smallest answer a route gives
    body = request.get_data()
    return jsonify({"bytes": len(body), "label": "bare"})


@app.get("/readyz")
def ready():  # noqa: ANN201
    return jsonify({"ready": True})
