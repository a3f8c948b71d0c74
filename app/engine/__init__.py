"""The engine: decoding, batching, weights, the predictor and the per-model service with its stage runner.

It knows nothing of HTTP: no module here imports Flask or a protocol package (a test enforces it), so the web
layer and every protocol sit on top of it and a new protocol never copies the stage sequence.
"""
