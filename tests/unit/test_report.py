"""`raytrain report RUN_DIR`: PNG plots and a one-page summary.md of a run, resumes and resizes marked."""

from __future__ import annotations

import json

from PIL import Image

from raytrain_ext.cli import main
from trainers.metrics import read_metrics
from trainers.trainer import Trainer


def test_report_writes_plots_and_summary(tiny_config, capsys):
    cfg = tiny_config(train={"steps": 6, "eval_every": 3}, checkpoint={"every": 3})
    Trainer(cfg, progress=False).fit()
    longer = tiny_config(train={"steps": 9, "eval_every": 3}, checkpoint={"every": 3})
    Trainer(longer, progress=False).fit()  # resumes at step 6: a resume event to mark
    with (cfg.out_dir / "metrics.jsonl").open("a") as f:  # and a resize, as an elastic restart writes it
        f.write(
            json.dumps(
                {
                    "kind": "event",
                    "step": 6,
                    "time": 0,
                    "event": "resize",
                    "old_world_size": 2,
                    "new_world_size": 1,
                    "accumulation": 2,
                }
            )
            + "\n"
        )

    assert main(["report", str(cfg.out_dir)]) == 0
    out = cfg.out_dir / "report"
    names = {p.name for p in out.glob("*.png")}
    assert names == {
        f"{n}.png" for n in ("loss", "lr", "throughput", "memory", "grad_norm", "step_time", "overview")
    }
    for png in out.glob("*.png"):
        with Image.open(png) as image:
            assert image.format == "PNG" and image.width > 300 and image.height > 200
    summary = (out / "summary.md").read_text()
    rows = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    evals = read_metrics(cfg.out_dir / "metrics.jsonl", "eval")
    assert summary.startswith("# Run report: t")
    assert "| steps | 9 of 9 |" in summary
    assert f"| train loss | {rows[-1]['loss']:.4f} at the last step" in summary
    best = min(evals, key=lambda r: r["val_loss"])
    assert f"{evals[-1]['val_loss']:.4f} last; {best['val_loss']:.4f} best (step {best['step']})" in summary
    assert "resumed at step 6 on 1 workers" in summary and "resized 2 -> 1 workers at step 6" in summary
    assert "step_00000009" in summary and "![overview](overview.png)" in summary
    assert len(summary.splitlines()) < 40, "one page"
    assert "wrote 7 plots" in capsys.readouterr().out


def test_moe_run_gets_a_load_panel(tiny_config):
    cfg = tiny_config(
        model={"moe": {"num_experts": 4, "top_k": 2}}, train={"steps": 6}, checkpoint={"every": 6}
    )
    Trainer(cfg, progress=False).fit()
    assert main(["report", str(cfg.out_dir)]) == 0
    assert (cfg.out_dir / "report" / "moe.png").is_file()
    assert "| MoE | load imbalance" in (cfg.out_dir / "report" / "summary.md").read_text()


def test_report_of_a_folder_without_steps_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no training steps in metrics.jsonl" in err


def test_a_folder_of_run_folders_is_read_as_one_run_in_time_order(tiny_config):
    """A Tune trial's folder: a second Train run continued from the first one's checkpoint at step 3."""
    first = tiny_config("trial/a", train={"steps": 6, "eval_every": 3}, checkpoint={"every": 3})
    Trainer(first, progress=False).fit()
    donor = first.out_dir / "checkpoints" / "step_00000003"
    second = tiny_config(
        "trial/b",
        optimizer={"lr": 1e-3},
        train={"steps": 9, "eval_every": 3},
        checkpoint={"every": 3, "resume": str(donor)},
    )
    Trainer(second, progress=False).fit()
    assert main(["report", str(first.out_dir.parent)]) == 0
    summary = (first.out_dir.parent / "report" / "summary.md").read_text()
    assert "| runs | 2 run folders in time order; 9 steps recorded |" in summary
    last = read_metrics(second.out_dir / "metrics.jsonl", "train")[-1]
    assert f"| train loss | {last['loss']:.4f} at the last step" in summary
    assert "resumed at step 3 on 1 workers" in summary
