"""Finding the user's source line for something that happened deep inside torch."""

from __future__ import annotations

import os
import re
import sys
from types import CodeType, FrameType

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
    known = _INTERNAL.get(filename)
    if known is None:
        if len(_INTERNAL) > 65536:  # bounded, whatever generates file names
            _INTERNAL.clear()
        known = _INTERNAL[filename] = not filename.startswith(_DEMOS_DIR) and (
            filename.startswith(_SKIPPED_DIRS) or filename.endswith(_CONTEXTLIB)
        )
    return known


# file name -> whether its frames are torch's or deadweight's: every traced module
# call and cut walks the stack through the same few files
_INTERNAL: dict[str, bool] = {}


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame outside torch and deadweight, walking outward from `start`."""
    frame: FrameType | None = start if start is not None else sys._getframe(1)
    known = _INTERNAL
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = known.get(filename)  # `_is_internal`, inlined: every module call walks
        if internal is None:
            internal = _is_internal(filename)
        if not internal:
            return frame
        frame = frame.f_back
    return None


def is_user_frame(frame: FrameType) -> bool:
    return not _is_internal(frame.f_code.co_filename)


def outermost_user_frame(start: FrameType | None, entry: FrameType) -> FrameType | None:
    """The outermost user frame from `start` outward to `entry` (a frame on the same
    stack, included): for an op run in a no-grad region, the frame inside the region
    that the user's code entered it from. None when `entry` is not on the stack."""
    found = None
    frame = start
    while frame is not None:
        if is_user_frame(frame):
            found = frame
        if frame is entry:
            return found
        frame = frame.f_back
    return None


def caller_frame(frame: FrameType) -> FrameType | None:
    """The user frame that called `frame`'s function. A torch.compile resume function
    runs the rest of a function after a graph break, called from that same function:
    its caller is the function's caller."""
    caller = user_frame(frame.f_back)
    if caller is not None and _resumed(frame) and _same_function(caller, frame):
        caller = user_frame(caller.f_back)
    return caller


# torch.compile names the function that resumes `forward` after a graph break at line 75
# `torch_dynamo_resume_in_forward_at_75` (torch/_dynamo/resume_execution.py); its
# qualname keeps the owner: `Block.torch_dynamo_resume_in_forward_at_75`.
_RESUME = re.compile(r"torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")


def function_name(frame: FrameType) -> str:
    """`Block.forward`: the qualified name (3.11+; the bare name before), and for a
    torch.compile resume function the name of the user's function it resumes."""
    return code_name(frame.f_code)


def code_name(code: CodeType) -> str:
    """`function_name` of the frames that run `code`."""
    # co_qualname (3.11+) says `FusedRMSNorm.forward` where co_name only says `forward`.
    name: str = getattr(code, "co_qualname", code.co_name)
    owner, _, leaf = name.rpartition(".")
    resumed = _RESUME.match(leaf)
    if resumed is None:
        return name
    return f"{owner}.{resumed['name']}" if owner else resumed["name"]


def _resumed(frame: FrameType) -> bool:
    return _RESUME.match(frame.f_code.co_name) is not None


def _same_function(a: FrameType, b: FrameType) -> bool:
    return a.f_code.co_filename == b.f_code.co_filename and function_name(a) == function_name(b)


def site_of(frame: FrameType | None) -> Site | None:
    if frame is None:
        return None
    # A resume function's lines are the user's function's own: only its name is dynamo's.
    return Site(frame.f_code.co_filename, frame.f_lineno, function_name(frame))


def site_at(where: tuple[CodeType, int] | None) -> Site | None:
    """`site_of` a frame from its code and line, kept by `user_place`."""
    if where is None:
        return None
    code, line = where
    return Site(code.co_filename, line, code_name(code))


def user_place(start: FrameType) -> tuple[CodeType, int] | None:
    """The user frame's code and line, from which `site_at` makes its `Site` when one is
    wanted: a tracer that notes a place per call but shows few saves the name lookup
    and the `Site` for the rest, and holds no frame (which would keep its locals)."""
    frame = user_frame(start)
    return None if frame is None else (frame.f_code, frame.f_lineno)


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
