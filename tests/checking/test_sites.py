from __future__ import annotations

import os
import sys

import torch

from deadweight.checking.check_stats import display_path
from deadweight.checking.sites import definition_site, user_frame, user_site


def test_user_site_skips_torch_frames():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(user_site())
            return x

    Probe()(torch.ones(1))
    assert seen[0].file == __file__
    assert seen[0].function.endswith("Probe.forward")


def test_definition_site_of_module_instance():
    site = definition_site(torch.nn.Linear(1, 1))
    assert site is not None and site.file.endswith(os.path.join("nn", "modules", "linear.py"))


def test_display_path_is_relative_below_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert display_path(str(tmp_path / "a" / "m.py")) == os.path.join("a", "m.py")
    assert display_path("/elsewhere/m.py") == "/elsewhere/m.py"


def test_a_torch_compile_resume_function_is_named_as_the_users_function():
    # After a graph break torch.compile runs the rest of `forward` as a new function,
    # `Net.torch_dynamo_resume_in_forward_at_<line>`, in the user's file and lines.
    from deadweight.checking.sites import caller_frame, site_of
    from tests.conftest import marker_line

    seen = []

    @torch._dynamo.disable  # run eagerly, from the resume function's frame
    def probe():
        frame = user_frame(sys._getframe(1))
        seen.append((frame.f_code.co_name, site_of(frame), site_of(caller_frame(frame))))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            h = self.fc(x)
            torch._dynamo.graph_break()
            h = h * 2
            probe()  # PROBE
            return h

    def run():
        return compiled(torch.ones(1, 2))  # RUN

    compiled = torch.compile(Net(), backend="eager")
    torch._dynamo.reset()
    try:
        run()
    finally:
        torch._dynamo.reset()
    [(raw, site, caller)] = seen
    assert raw.startswith("torch_dynamo_resume_in_forward_at_")  # what torch named it
    assert site.function.endswith("<locals>.Net.forward"), site
    assert site.line == marker_line(Net, "PROBE") and site.file == __file__
    # its caller is forward's caller, not the part of forward before the break
    assert caller.line == marker_line(run, "RUN") and caller.function.endswith("run")


def _this_frame():
    return sys._getframe()


def test_resume_names_keep_the_functions_own_name():
    from deadweight.checking.sites import function_name

    for qualname, expected in [
        ("Block.torch_dynamo_resume_in_look_at_me_at_12", "Block.look_at_me"),
        ("torch_dynamo_resume_in_look_at_me_at_3", "look_at_me"),
        ("Block.forward", "Block.forward"),
    ]:
        code = _this_frame.__code__.replace(co_name=qualname.rpartition(".")[2])
        if sys.version_info >= (3, 11):
            code = code.replace(co_qualname=qualname)
        else:  # no qualname before 3.11: the bare name
            expected = expected.rpartition(".")[2]
        frame = type(_this_frame)(code, globals())()
        assert function_name(frame) == expected
