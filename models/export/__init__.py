"""Export: what training hands the server. A weights directory (``manifest.py``: what it holds; ``torchscript.py``
and ``compile.py``: its formats), written by ``write.py`` (``python -m models.export``), kept in a model repository
(``repository.py``)."""
