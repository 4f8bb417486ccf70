"""TRL's SFTTrainer fine-tuning a tiny Llama with LoRA adapters (PEFT), watched by
DeadweightCallback: the transformers Trainer under accelerate, as recipes use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e import seeded

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from deadweight.integrations.transformers import DeadweightCallback  # noqa: E402

STEPS = 60  # past DW301's 50 steps


def _tokenizer() -> Any:
    """A word-level tokenizer built here: nothing is downloaded."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(seeded.VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t1"
    )


def _sft(tmp_path: Path, model: Any) -> Any:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, seeded.VOCAB, (64, seeded.SEQ), generator=gen).tolist()
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        max_length=seeded.SEQ,
    )
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    dw = DeadweightCallback(every=10, log=tmp_path / "run.jsonl")
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
        processing_class=_tokenizer(),
        peft_config=lora,
        callbacks=[dw],
    )
    with dw:
        trainer.train()
    assert dw.report is not None
    return dw.report


def test_a_healthy_lora_fine_tune_has_no_findings(tmp_path: Path) -> None:
    report = _sft(tmp_path, seeded.tiny_llama())
    assert report.subject["steps"] == STEPS
    assert not report.findings, report
    # Only the adapters train, named as in the user's model (no `base_model.model.`).
    log = (tmp_path / "run.jsonl").read_text()
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in log
    assert "base_model.model." not in log


def test_a_detached_layer_leaves_its_adapters_unchanged(tmp_path: Path) -> None:
    model = seeded.tiny_llama()
    seeded.detach_first_layer(model)
    report = _sft(tmp_path, model)
    never = [f for f in report.findings if f.code == "DW301"]
    assert len(never) == 1, report
    assert set(never[0].params) == {
        f"model.layers.0.self_attn.{proj}.lora_{ab}.default.weight"
        for proj in ("q_proj", "v_proj")
        for ab in "AB"
    }
