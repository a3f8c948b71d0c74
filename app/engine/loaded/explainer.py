"""Explainer: one loaded version's explanations (models/explain.py's Grad-CAM), on a copy of its weights that has
gradients, made on first use (or in its load: EXPLAIN_AT_START) and dropped with the version.

The weights: the eager module the version serves (a state dict, or a module handed in), copied so that the hooks and
the backward pass never touch the one its batches run; else, for a format without gradients (ONNX Runtime, an
AOTInductor or int8 package, TorchScript, whose modules take no hooks), the export's state dict, loaded strictly
into its architecture. A version with neither is refused (NoGradients, 422) naming what to export.

The class and its score are the version's own: its serving forward pass on the same pixels (its dtype, format and
device), so an explanation names the class /predict answers with the score it answers, even where that copy's float32
numbers differ (a bfloat16 version, an int8 package, ONNX Runtime: a near tie can go the other way there). The map
is that copy's gradients for that class, in float32 throughout: a version of another dtype is explained with its
export's float32 weights (its own copy would carry its rounded ones) on its pixels before they were rounded to its
dtype (the device path makes a batch's pixels in the version's dtype: here in float32).
"""
from __future__ import annotations

import copy
import logging
import time

import numpy as np
import torch
import torch.nn as nn

from app.engine.contract import Explanation
from app.engine.decoding.decoders import Decoder
from app.engine.decoding.image import load_upright, open_checked
from app.engine.loaded.predictor import NonFiniteOutput, Predictor
from app.errors import BadRequest, NoGradients
from models.explain import METHOD, NoFeatureMap, crop_box, feature_layer, grad_cam, overlay
from models.export.checks import ModelLoadError, checked_file
from models.export.load import load_module

log = logging.getLogger(__name__)

EAGER_FORMATS = ("state_dict", "eager")  # what a Predictor serves as a plain module with gradients


def _gradient_module(predictor: Predictor) -> tuple[nn.Module, str]:
    """A module with gradients giving the version's answers, in float32 on its device, and the format it came
    from; NoGradients when the version has none."""
    manifest = predictor.manifest
    exported = predictor.weights_dir is not None and "state_dict" in manifest.files
    if predictor.weights_format in EAGER_FORMATS and (predictor.dtype == torch.float32 or not exported):
        # (a version of another dtype: its export's float32 weights, where its own were rounded to that dtype)
        return copy.deepcopy(predictor.module).float().eval(), predictor.weights_format
    where = f"{manifest.name} version {manifest.version}"
    if not exported:
        raise NoGradients(f"{where} serves {predictor.weights_format} weights, which have no gradients, and its "
                          f"export holds no state dict to explain with: export it again with python -m "
                          f"models.export, from its run's checkpoint or, trained elsewhere, from its state dict "
                          f"(--state-dict FILE --arch ARCH): each writes model.state_dict.pt")
    try:
        module = load_module(checked_file(predictor.weights_dir, manifest, "state_dict"), manifest, "state_dict")
    except ModelLoadError as exc:
        raise NoGradients(f"{where}: its state dict cannot be loaded to explain with: {exc}") from None
    return module.to(predictor.device).eval(), "state_dict"


class Explainer:
    """Grad-CAM for one version: ``explain`` decodes an image as its requests are (its decoder: the same limits,
    path and pixels), takes the class (unless named) and its score from the version's serving forward pass (so both
    are the ones /predict answers), runs one forward and one backward pass of the copy with gradients and answers
    the map (and its overlay PNG when asked, drawn on the photo as PIL opens it)."""

    def __init__(self, predictor: Predictor, decoder: Decoder) -> None:
        self.predictor, self.limits = predictor, decoder.limits
        self.pixels = decoder.in_float32()  # the gradients' input: its batch's pixels before the version's dtype
        self.module, self.weights = _gradient_module(predictor)
        try:
            self.layer = feature_layer(self.module, predictor.manifest.preprocess.input_shape)
        except NoFeatureMap as exc:
            raise NoGradients(f"{predictor.manifest.name} version {predictor.manifest.version} cannot be explained "
                              f"with Grad-CAM: {exc}") from None
        log.info("%s %s: explanations on its %s weights, feature map %s", predictor.manifest.name,
                 predictor.manifest.version, self.weights, self.layer)

    def explain(self, image: bytes, index: int | None = None, png: bool = False) -> Explanation:
        """The map of ``image`` for class ``index`` (None: the top one); ServiceErrors for an image the decode
        rules refuse or a class out of range."""
        manifest = self.predictor.manifest
        if index is not None and not 0 <= index < manifest.num_classes:
            raise BadRequest(f"class_index must be from 0 to {manifest.num_classes - 1}, got {index}")
        started = time.perf_counter()
        opened = open_checked(image, self.limits)
        stored = opened.size  # before a large JPEG's reduced-scale decode, and before its EXIF turn
        photo = load_upright(opened, self.limits)
        prepared = self.pixels.prepare_decoded(photo)  # as a request's pixels, its photo decoded once
        pixels = self.pixels.collate([self.pixels.prepare(image) if prepared is None else prepared])[0]
        turned = (stored[0] > stored[1]) != (photo.width > photo.height) and stored[0] != stored[1]
        width, height = stored[::-1] if turned else stored  # the upright photo's own pixels
        served = self._served_probabilities(pixels)
        chosen = int(served.argmax()) if index is None else index
        found = grad_cam(self.module, self.layer, pixels, chosen)
        rendered = overlay(photo, found.grid, manifest.preprocess) if png else None
        return Explanation(
            manifest.name, manifest.version, chosen, manifest.labels[chosen], float(served[chosen]), METHOD,
            self.layer, self.weights, np.round(found.grid.astype(np.float64), 4).tolist(),
            crop_box(width, height, manifest.preprocess), (time.perf_counter() - started) * 1000, rendered)

    def _served_probabilities(self, pixels: torch.Tensor) -> np.ndarray:
        """The version's probabilities for one image's ``pixels`` from its serving forward pass (what /predict
        answers); the image's InferenceFailed when the model answers NaN or infinity for it, as /predict's."""
        try:
            return self.predictor.probabilities(pixels[None])[0].numpy()
        except NonFiniteOutput as failed:
            raise failed.errors[0] from None
