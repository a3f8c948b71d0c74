"""TorchScript helpers shared by the export (which writes the format) and the server (which loads it)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Silence torch.jit's deprecation notices.

    torch.jit is deprecated upstream but is still the one self-contained format a server can load without the
    Python class that defined the model, so we keep offering it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        yield
