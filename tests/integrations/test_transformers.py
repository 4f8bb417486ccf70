"""DeadweightCallback in a real transformers Trainer on a tiny random GPT-2."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations._tensorboard import read_events
from tests.tiny_transformers import gpt2_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from deadweight.integrations.transformers import DeadweightCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.ids = torch.randint(0, 100, (64, 16))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2(cut: bool = False) -> Any:
    model = transformers.GPT2LMHeadModel(gpt2_config())
    if cut:
        # A norm that records no backward (the first incident's fused RMSNorm): its
        # weight and bias never get a gradient.
        norm = model.transformer.h[0].ln_2
        forward = norm.forward

        def no_backward(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return forward(x)

        norm.forward = no_backward
    return model


def trainer(
    tmp_path: Path,
    model: Any,
    callbacks: list[Any],
    *,
    report_to: list[str] | None = None,
    max_steps: int = 60,
) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=report_to or [],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def hooks_left(t: Any) -> int:
    opt = t.optimizer.optimizer  # accelerate's wrapper holds the torch optimizer
    return len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def test_never_learning_norm_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dw = DeadweightCallback(every=10, log=tmp_path / "run.jsonl")
    t = trainer(tmp_path, gpt2(cut=True), [dw])
    with caplog.at_level(logging.INFO, logger="deadweight"):
        t.train()
    assert dw.report is not None
    (finding,) = dw.report.by_code("DW301")
    assert set(finding.params) == {"transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias"}
    assert finding.evidence["steps"] == 60
    assert dw.report.subject["end"] == "closed"
    assert hooks_left(t) == 0
    assert (tmp_path / "run.jsonl").stat().st_size > 0
    # The report goes to the log (library code never prints), as a warning.
    records = [r for r in caplog.records if r.name == "deadweight.integrations.transformers"]
    assert records and records[-1].levelno == logging.WARNING
    assert "DW301" in records[-1].getMessage()


def test_healthy_run_is_quiet(tmp_path: Path) -> None:
    dw = DeadweightCallback(every=10)
    t = trainer(tmp_path, gpt2(), [dw])
    t.train()
    assert dw.report is not None and dw.report.ok, str(dw.report)
    assert dw.report.subject["steps"] == 60
    assert hooks_left(t) == 0
    assert dw.close() is dw.report  # closing again changes nothing
    assert dw.watch is not None
    dw.watch.close()  # nor does closing the watch itself


def test_forwards_into_the_trainers_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    dw = DeadweightCallback(every=10)  # forward="auto"
    t = trainer(tmp_path, gpt2(cut=True), [dw], report_to=["tensorboard"])
    t.train()
    scalars, texts = read_events(tmp_path / "out")
    assert "train/loss" in scalars  # the Trainer's own, in the same run
    ratio = scalars["deadweight/update_ratio/transformer.h.1.ln_1.weight"]
    assert [step for step, _ in ratio] == [1, 10, 20, 30, 40, 50, 60]
    assert "deadweight/grad_rms/transformer.h.0.ln_1.bias" in scalars
    assert scalars["deadweight/summary/unmoved"][-1] == (60, 2.0)
    assert scalars["deadweight/findings/error"] == [(60, 1.0)]
    assert "transformer.h.0.ln_2.weight" in texts["deadweight/findings/text_summary"]
    assert dw.report is not None and not dw.report.subject["detector_errors"]
    # The TensorBoardCallback closed its writer before our on_train_end; the findings
    # reopened it, and the forwarder closed it again.
    (forwarder,) = dw._session.forwarders
    assert forwarder.writer.all_writers is None


def test_forwards_into_the_trainers_wandb_run(tmp_path: Path, offline_wandb: Any) -> None:
    dw = DeadweightCallback(every=10)  # forward="auto"
    trainer(tmp_path, gpt2(cut=True), [dw], report_to=["wandb"]).train()
    run = offline_wandb.run  # the one WandbCallback started
    (forwarder,) = dw._session.forwarders
    assert forwarder.run is run
    assert run.summary["deadweight/findings/error"] == 1
    assert run.summary["deadweight/step"] == 60
    assert run.summary.get("deadweight/grad_rms/transformer.h.1.ln_2.weight") is not None


def test_no_forwarding_without_a_tracker(tmp_path: Path) -> None:
    dw = DeadweightCallback(every=10, forward="auto")
    t = trainer(tmp_path, gpt2(), [dw], max_steps=3)
    t.train()
    assert dw._session.forwarders == []
    assert not list((tmp_path / "out").rglob("events.out.tfevents.*"))


class Explode(transformers.TrainerCallback):  # type: ignore[misc]
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 5:
            raise RuntimeError("boom at step 5")


def test_exception_leaves_no_hooks(tmp_path: Path) -> None:
    dw = DeadweightCallback(every=2)
    t = trainer(tmp_path, gpt2(), [dw, Explode()])
    with pytest.raises(RuntimeError, match="boom"), dw:
        t.train()
    assert hooks_left(t) == 0
    assert dw.report is not None
    assert dw.report.subject["end"] == "raised RuntimeError: boom at step 5"
    assert dw.report.subject["steps"] == 5


def test_next_train_closes_a_stale_watch(tmp_path: Path) -> None:
    dw = DeadweightCallback(every=2)
    explode = Explode()
    t = trainer(tmp_path, gpt2(), [dw, explode], max_steps=8)
    with pytest.raises(RuntimeError):
        t.train()  # no `with dw:`: the Trainer never calls on_train_end
    stale = dw.watch
    assert hooks_left(t) == 2  # still hooked: nothing told the callback
    t.remove_callback(explode)
    t.train()
    assert stale is not None and stale is not dw.watch
    assert stale.report().subject["end"].startswith("not closed")
    assert hooks_left(t) == 0
    assert dw.report is not None and dw.report.subject["end"] == "closed"


def test_forward_must_be_a_known_choice() -> None:
    with pytest.raises(ValueError, match="forward must be one of"):
        DeadweightCallback(forward="mlflow")


def test_the_trainers_logged_loss_is_recorded(tmp_path: Path) -> None:
    dw = DeadweightCallback(every=10)
    t = trainer(tmp_path, gpt2(), [dw])  # logging_steps=10
    t.train()
    assert dw.watch is not None
    logged = [(e["step"], e["loss"]) for e in t.state.log_history if "loss" in e]
    assert [s for s, _ in logged] == [10, 20, 30, 40, 50, 60]
    stats = dw.watch.stats
    assert stats.loss_steps == [s for s, _ in logged]
    assert stats.loss_values == pytest.approx([v for _, v in logged], rel=1e-6)
