"""Bytes to the model's input: every limit checked on the header before any pixel, then one decode path per loaded
version (``pil``, ``tensor`` or ``device``), each a ``Decoder`` with ``prepare`` (request thread) and ``collate``
(batch worker). Imports nothing else of the engine."""
