"""Training benchmarks: the training step's speed against its limit (``python -m bench.training.train``), the two
data paths' accuracy (``parity``) and the recipes on a new user's small folder (``small_folder``)."""
