"""The queue and the one thread that runs a version's forward passes: dynamic batches under a cap measured at
warm-up, deadlines, background work, and the requests still on their way. Knows neither the model nor decoding;
imports nothing else of the engine."""
