"""Tests that start no app and no server: the batcher, decoding, presets, settings, the worker's request reading,
the benchmarks' parts, and the house rules."""
