"""Model side of visionserve: architectures, preprocessing presets, training and export."""
