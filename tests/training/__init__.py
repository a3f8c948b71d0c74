"""The training script, its parts, the GPU data path and the training benchmark."""
