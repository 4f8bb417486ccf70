"""DW511 on Rust sources in candle's style: the first incident's training loop fires at the
fused calls, its forward_diff version is clean, and names resolve as rustc would."""

from __future__ import annotations

from pathlib import Path

import pytest

import deadweight
from deadweight.config import Config
from deadweight.linting import source_rust
from tests.linting.helpers import lines_of, lint_source, marked, positions, write

pytest.importorskip("tree_sitter_rust")

# The incident: Linear(8 -> 8) -> RmsNorm -> Linear(8 -> 1), SGD, a student/teacher pair.
SEED = """
use candle::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{linear, ops, rms_norm, Linear, Optimizer, RmsNorm, VarBuilder, VarMap, SGD};

struct Student {
    l1: Linear,
    norm: RmsNorm,
    l2: Linear,
}

impl Module for Student {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.l1.forward(x)?;
        let h = self.norm.forward(&h)?; // DW511
        let attn = ops::softmax_last_dim(&h)?; // DW511
        self.l2.forward(&(h * attn)?)
    }
}

fn train(dev: &Device, x: &Tensor, y: &Tensor, diff: bool) -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
    let l1 = linear(8, 8, vb.pp("l1"))?;
    let norm = rms_norm(8, 1e-5, vb.pp("norm"))?;
    let l2 = linear(8, 1, vb.pp("l2"))?;
    let mut opt = SGD::new(varmap.all_vars(), 0.1)?;
    for step in 0..=1000 {
        let h = l1.forward(x)?;
        let h = if diff { norm.forward_diff(&h)? } else { norm.forward(&h)? }; // DW511
        let loss = (l2.forward(&h)? - y)?.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        if step == 0 {
            println!("w1 has grad: {}", grads.get(l1.weight()).is_some());
        }
        opt.step(&grads)?;
    }
    Ok(())
}
"""

CORRECTED = """
use candle::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{linear, ops, rms_norm, Linear, Optimizer, RmsNorm, VarBuilder, VarMap, SGD};

struct Student {
    l1: Linear,
    norm: RmsNorm,
    l2: Linear,
}

impl Module for Student {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.l1.forward(x)?;
        let h = self.norm.forward_diff(&h)?;
        let attn = ops::softmax(&h, D::Minus1)?;
        let h = ops::rms_norm_slow(&h, self.norm.weight(), 1e-5)?;
        self.l2.forward(&(h * attn)?)
    }
}

fn train(dev: &Device, x: &Tensor, y: &Tensor) -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
    let l1 = linear(8, 8, vb.pp("l1"))?;
    let norm = rms_norm(8, 1e-5, vb.pp("norm"))?;
    let l2 = linear(8, 1, vb.pp("l2"))?;
    let mut opt = SGD::new(varmap.all_vars(), 0.1)?;
    for _ in 0..=1000 {
        let h = norm.forward_diff(&l1.forward(x)?)?;
        let loss = (l2.forward(&h)? - y)?.sqr()?.mean_all()?;
        opt.backward_step(&loss)?;
    }
    Ok(())
}
"""


def test_seed_training_loop_fires_at_the_fused_calls(tmp_path: Path) -> None:
    report = lint_source(tmp_path, SEED, "student.rs")
    assert lines_of(report, "DW511") == marked(SEED, "DW511")
    norm, softmax, loop_norm = report.by_code("DW511")
    assert norm.location.column == 27  # `forward` in `self.norm.forward(&h)`
    assert norm.location.function == "Student::forward"
    assert "`self.norm` is a candle_nn RmsNorm" in norm.message
    assert "self.norm.forward_diff(&xs)" in norm.message
    assert (
        softmax.location.column == 20
        and "candle_nn::ops::softmax(&xs, D::Minus1)" in softmax.message
    )
    assert loop_norm.location.function == "train" and "norm.forward_diff" in loop_norm.message


def test_corrected_seed_is_clean(tmp_path: Path) -> None:
    report = lint_source(tmp_path, CORRECTED, "student.rs")
    assert report.findings == () and report.subject["errors"] == []


OPS = """
use candle_nn as nn;
use candle_nn::ops::rms_norm as fused_rms;
use candle_nn::rotary_emb::{rope, rope_i as rope_interleaved, rope_thd};

fn attention(q: &Tensor, k: &Tensor, v: &Tensor, cos: &Tensor, sin: &Tensor, a: &Tensor) -> Result<Tensor> {
    let q = rope(q, cos, sin)?; // DW511
    let k = rope_interleaved(k, cos, sin)?; // DW511
    let v = rope_thd(v, cos, sin)?; // DW511
    let x = fused_rms(&q, a, 1e-6)?; // DW511
    let y = candle_nn::ops::layer_norm(&x, a, a, 1e-5)?; // DW511
    let z = nn::ops::sdpa(&q, &k, &v, 1.0, 1.0)?; // DW511
    let w = nn::ops::softmax_last_dim(&z)?; // DW511
    let ln = nn::LayerNorm::new(a.clone(), a.clone(), 1e-5);
    let out = w.apply(&ln)?; // DW511
    xs.apply_op2_no_bwd(alpha, &MyKernel { eps }) // DW511
}
"""


def test_every_fused_op_under_any_import_name(tmp_path: Path) -> None:
    report = lint_source(tmp_path, OPS, "ops.rs")
    assert lines_of(report, "DW511") == marked(OPS, "DW511")
    messages = [f.message for f in report.by_code("DW511")]
    assert "rope_slow" in messages[0] and "rope_i_slow" in messages[1]
    assert "no slow variant" in messages[2]
    assert "rms_norm_slow" in messages[3] and "layer_norm_slow" in messages[4]
    assert "LayerNorm has no forward_diff" in messages[7]
    assert "apply_op2 with a CustomOp that implements bwd" in messages[8]


NOT_CANDLE = """
use candle::{Module, Result, Tensor};

// A model crate's own RmsNorm wrapper: its forward is its own business.
struct RmsNorm {
    inner: candle_nn::RmsNorm,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward_diff(x)
    }
}

mod ops {
    pub fn softmax_last_dim(x: &candle::Tensor) -> candle::Result<candle::Tensor> { Ok(x.clone()) }
}

fn run(norm: &RmsNorm, x: &Tensor, layer: &Linear) -> Result<Tensor> {
    let h = norm.forward(x)?;
    let h = ops::softmax_last_dim(&h)?;
    let softmax_last_dim = 3;
    let text = "ops::softmax_last_dim(&h) and norm.forward(&h)";
    // candle_nn::ops::softmax_last_dim(&h) in a comment
    layer.forward(&h)
}
"""


def test_local_types_comments_and_strings_do_not_fire(tmp_path: Path) -> None:
    assert lint_source(tmp_path, NOT_CANDLE, "local.rs").findings == ()


def test_inference_only_files_and_functions(tmp_path: Path) -> None:
    path = write(tmp_path, SEED, "src/student.rs")
    config = Config(root=tmp_path, inference_only=("src/student.rs::Student::forward",))
    report = deadweight.lint_paths([path], config=config)
    assert lines_of(report, "DW511") == [marked(SEED, "DW511")[2]]
    assert report.subject["inference_only"] == 2
    whole = Config(root=tmp_path, inference_only=("src/**",))
    assert deadweight.lint_paths([path], config=whole).findings == ()
    by_name = Config(root=tmp_path, inference_only=("**::train",))
    assert len(deadweight.lint_paths([path], config=by_name).findings) == 2


def test_suppression_comment(tmp_path: Path) -> None:
    source = SEED.replace(
        "let attn = ops::softmax_last_dim(&h)?; // DW511",
        "let attn = ops::softmax_last_dim(&h)?; // deadweight: ignore[DW511]",
    )
    report = lint_source(tmp_path, source, "student.rs")
    assert len(report.by_code("DW511")) == 2 and report.subject["suppressed"] == 1


def test_broken_rust_is_reported_and_the_rest_linted(tmp_path: Path) -> None:
    source = "fn broken( {\n" + SEED
    report = lint_source(tmp_path, source, "broken.rs")
    (error,) = report.subject["errors"]
    assert "does not parse as Rust" in error["message"] and error["line"] == 1
    assert report.subject["files"] == 1 and report.by_code("DW511")


def test_missing_extra_gives_one_diagnostic_and_python_still_linted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> None:
        raise source_rust.MissingParser("no tree-sitter")

    monkeypatch.setattr(source_rust, "parser", missing)
    write(tmp_path, SEED, "a.rs")
    write(tmp_path, SEED, "b.rs")
    write(tmp_path, "import torch\nh = torch.utils.checkpoint.checkpoint(f, x)\n", "c.py")
    report = deadweight.lint_paths([tmp_path], config=None)
    (error,) = report.subject["errors"]
    assert "2 Rust files not linted" in error["message"]
    assert 'pip install "deadweight[rust]"' in error["message"]
    assert report.subject["files"] == 1 and positions(report, "DW504") == [(2, 5)]
