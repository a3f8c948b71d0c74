"""The parts of a training run that ``models/train.py`` reads top to bottom: ``args.py`` (its options), ``amp.py``
and ``optim.py`` (the step's mixed precision, the model, optimiser and schedule), ``distributed.py`` (torchrun),
``checkpoint.py`` (checkpoints, starting or resuming), ``report.py`` (epoch lines, metrics.jsonl, TensorBoard),
``confusion.py`` (the confusion matrix) and ``device_stats.py`` (device values read without stalling)."""
