"""Finding the user's source line for something that happened deep inside torch."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

import deadweight
from deadweight.checking.check_stats import Site

# Frames from these directories are never "the user's line": torch's own code (the
# no_grad decorator wrapper, nn.Module.__call__, checkpoint) and deadweight's.
_SKIPPED_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, deadweight) if m.__file__
)
# ...except the demo models that ship inside the package: their lines are the story.
_DEMOS_DIR = os.path.join(_SKIPPED_DIRS[-1], "demos") + os.sep
_CONTEXTLIB = "contextlib.py"


def _is_internal(filename: str) -> bool:
    if filename.startswith(_DEMOS_DIR):
        return False
    return filename.startswith(_SKIPPED_DIRS) or filename.endswith(_CONTEXTLIB)


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame outside torch and deadweight, walking outward from `start`."""
    frame: FrameType | None = start if start is not None else sys._getframe(1)
    while frame is not None:
        if not _is_internal(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def site_of(frame: FrameType | None) -> Site | None:
    if frame is None:
        return None
    code = frame.f_code
    # co_qualname (3.11+) says `FusedRMSNorm.forward` where co_name only says `forward`.
    return Site(code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name))


def user_site(start: FrameType | None = None) -> Site | None:
    return site_of(user_frame(start if start is not None else sys._getframe(1)))


def definition_site(obj: object) -> Site | None:
    """Where a class or function is defined, for things that have no call site."""
    import inspect

    target = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    try:
        file = inspect.getsourcefile(target)
        _, line = inspect.getsourcelines(target)
    except (OSError, TypeError):
        return None
    if file is None:
        return None
    return Site(file, max(line, 1), getattr(target, "__qualname__", str(target)))
