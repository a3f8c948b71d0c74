"""The engine: decoding, batching, the loaded versions, rollouts and the versions machinery, in wings, and on top
the service (``admit``), the call (a request's stages, in order), the catalog and the contract the HTTP side sees.

It knows nothing of HTTP: no module here imports Flask or a protocol package (a test enforces it), so the web
layer and every protocol sit on top of it (in the worker, or across app/link/ in a process of its own) and a
new protocol never copies the stage sequence.
"""
