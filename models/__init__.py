"""Model side of visionserve: architectures, preprocessing presets, training and export.

    architectures.py, pretrained.py, presets.py   what a model is (and its embedding beside its logits), its
              packaged weights, its input transform
    explain.py   Grad-CAM: why a model chose a class, as a map and drawn over the photo (the server's /explain)
    serving.py, image_decode.py   the rules the server and models.predict share: the usable cores and the forward
              pass's threads (standard library only), an image's limits, header checks and upright decode
    data/     a training run's images: folders, loaders, augmentation, the GPU data path, JPEG decoding (CPU, device)
    run/      the training run's parts: options, step (amp, optim), torchrun, checkpoints and resume, reports
    export/   what training hands the server: the weights directory, its formats, the model repository
    train.py  python -m models.train (the script, top to bottom); plot.py: python -m models.plot
    neighbours.py  python -m models.neighbours: near-duplicates and nearest neighbours among the embeddings
              python -m models.predict --embeddings wrote

The server (``app/``) imports only the modules of ``SERVING_CONTRACT``, which import only each other
(tests/unit/test_house.py checks both): changing one of them changes what the server runs.
"""

SERVING_CONTRACT: tuple[str, ...] = (
    "models.architectures",  # build_model: a state-dict export's architecture
    "models.presets",  # the eval transform (PIL and tensor), the accepted image formats
    "models.serving",  # usable_cores, forward_threads: standard library only (the gunicorn master imports it)
    "models.commands",  # a printed command's interpreter (python_command): standard library only
    "models.image_decode",  # the decode rules: DecodeLimits, header checks, the upright decode, ImageRefused
    "models.data.jpeg",  # JPEG decoding on the CPU (the tensor path) and batched on a device (the device path)
    "models.data.malloc",  # glibc tuning for decode buffers (the server's workers, models.predict)
    "models.export.manifest",  # what a weights directory holds
    "models.export.checks",  # ModelLoadError; manifest, checksum, output shape, device and dtype checks
    "models.export.choose",  # which artefact serves: ONNX, an AOTInductor package, a weights file (FASTEST_ON)
    "models.export.load",  # the verified load of the chosen artefact (the server and models.predict)
    "models.export.repository",  # <repository>/<model>/<version>/
    "models.export.torchscript",  # quiet_jit around loading TorchScript
    "models.export.compile",  # the dtypes of AOTInductor packages
    "models.export.onnx_runtime",  # an ONNX file's ONNX Runtime session
    "models.explain",  # Grad-CAM and its overlay: the server's explanations
)
