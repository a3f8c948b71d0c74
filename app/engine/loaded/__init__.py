"""One model version loaded and running: its predictor (the verified model on its device), its decoder and
batcher, and the monitor of its predictions. ``LoadedVersion.run_batch`` is a batch's steps in one place.
Imports the decoding and batching wings only."""
