"""The unit of the serving budget (issue #50): a bare Flask app with one route that reads the posted body and answers
a small JSON, served by gunicorn with visionserve's worker class. Its CPU per request, measured with the same client
in the same run, is "one bare-Flask request". With ``BARE_WAIT_MS`` set, the route sleeps that long before it
answers: what the same request costs when it waits, as a request in process mode waits for its engine.

    python -m gunicorn -c /dev/null -k app.hosting.worker.BufferingWorker --threads 8 -w 2 -b 127.0.0.1:8001 \
        bench.serving.bare_app:app
"""
from __future__ import annotations

import os
import time

from flask import Flask, jsonify, request

app = Flask(__name__)
WAIT_S = float(os.environ.get("BARE_WAIT_MS", "0")) / 1000


@app.post("/predict")
def predict():  # noqa: ANN201 - the smallest answer a route gives
    body = request.get_data()
    if WAIT_S:
        time.sleep(WAIT_S)
    return jsonify({"bytes": len(body), "label": "bare"})


@app.get("/readyz")
def ready():  # noqa: ANN201
    return jsonify({"ready": True})
