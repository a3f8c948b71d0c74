"""How a command this project prints names the interpreter and the module to run, so that it runs as printed in a
fresh shell in this folder (``.venv/bin/python -m ...`` after ``make install``; ``python`` in the container): the
training run's summary and hints, models.predict's, and the server's messages that say which command fixes an
export. Standard library only (the server imports it: models.SERVING_CONTRACT)."""
from __future__ import annotations

import os
import shlex
import shutil
import sys


def command_path(executable: str | os.PathLike[str]) -> str:
    """How a printed command names ``executable`` so that it runs in a fresh shell in this folder: relative when it
    lies under the current folder (``.venv/bin/python``), its bare name when that is what PATH finds (in the
    container: ``python``), else its absolute path. Symlinks are not followed: a venv's ``bin/python`` links to a
    system python that lacks the venv's packages (torch)."""
    path = os.path.abspath(executable)
    try:
        here = os.getcwd()
    except OSError:  # the current folder was removed
        here = ""
    if here and os.path.commonpath([path, here]) == here:
        return shlex.quote(os.path.relpath(path, here))
    name = os.path.basename(path)
    found = shutil.which(name)
    return name if found and os.path.abspath(found) == path else shlex.quote(path)


def python_command() -> str:
    """This interpreter as a printed command names it (``.venv/bin/python`` after ``make install``): the one
    that has torch, which the system's ``python`` of a fresh shell lacks."""
    return command_path(sys.executable)


def module_command(module: str, argv: list[str]) -> str:
    """``<this python> -m module argv...``, quoted for a shell."""
    return f"{python_command()} -m {module} {shlex.join(argv)}".rstrip()
