"""Batch inference with the served artefact: ``python -m models.predict`` scores a folder, a file list or one image,
or evaluates the model on a labelled one, in process, on one device or many under torchrun.

    inputs.py    what to score: a folder, a file list or one image, each rank's share, the labels of an evaluation
    decode.py    reading and preprocessing one file as the server does (pil, tensor or device path), in the
                 DataLoader's workers; the batch on the model's device
    outputs.py   the records: each rank's part file (appended per batch, so a rerun skips what is written), the
                 merge into one file in input order, JSON lines, CSV or Parquet; with --embeddings each rank's rows
                 beside its part, merged into OUT.npy and OUT.names.txt
    evaluate.py  top-1/top-5, per-class precision and recall, the confusion matrix, the most confident mistakes
    __main__.py  the command: options, loading (models/export/load.py, as the server), the scoring loop
"""
