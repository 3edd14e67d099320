"""Progress of long work on a terminal: save_hf's line on stderr, and the
`weightsync export` command's under a pseudo-terminal (script(1)), read as
text. Real saves of real tensors; the totals must match what was written."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess

import pytest
import torch

import weightsync as ws
from helpers import cli, model_config
from weightsync import _progress


def test_line_format_and_layout_bytes():
    assert _progress.format_line("save_hf", 12e6, 48e6, 2.0) == \
        "save_hf: 12.0 / 48.0 MB, 6.0 MB/s, 6 s left"
    assert _progress.format_line("save_hf", 0, 48e6, 0.0) == "save_hf: 0.0 / 48.0 MB"
    layout = {"params": [{"global_shape": [3, 2], "dtype": "F32"},
                         {"global_shape": [6], "origin_shape": [5], "dtype": "BF16"}]}
    assert _progress.layout_bytes(json.dumps(layout)) == 3 * 2 * 4 + 5 * 2


def test_save_hf_shows_its_bytes_up_to_the_total(tmp_path, capfd):
    layout = json.loads(cli("trainer-layout", "--hf-config",
                            model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
    g = torch.Generator().manual_seed(3)
    out = str(tmp_path / "ckpt")
    with ws.Coordinator() as coord, \
            ws.Publisher(coordinator=coord.address, rank=0, layout=layout) as pub:
        for p in layout["params"]:
            pub.register(p["name"], torch.randn(p["global_shape"], generator=g)
                         .to(torch.bfloat16))
        quiet = pub.save_hf(out)  # stderr is no terminal here: nothing shown
        assert "save_hf:" not in capfd.readouterr().err
        res = pub.save_hf(out, progress=True)
    err = capfd.readouterr().err
    lines = [s for s in err.replace("\033[K", "").split("\r") if s.strip()]
    assert lines, err
    total_mb = f"{res.total_bytes / 1e6:.1f}"
    assert res.total_bytes == quiet.total_bytes == _progress.layout_bytes(json.dumps(layout))
    # The last report: everything on disk, out of the checkpoint's bytes.
    assert lines[-1].strip().startswith(f"save_hf: {total_mb} / {total_mb} MB"), lines[-1]


def test_save_hf_progress_off_draws_nothing(tmp_path):
    stream = io.StringIO()
    with _progress.DirProgress("x", str(tmp_path), 100, enabled=None, stream=stream) as p:
        pass
    assert not p.enabled and stream.getvalue() == ""  # a StringIO is no terminal


@pytest.mark.skipif(shutil.which("script") is None, reason="script(1) is not installed")
def test_export_shows_progress_on_a_terminal_only(tmp_path):
    config = model_config("tiny-llama") + "/config.json"
    one = json.loads(cli("trainer-layout", "--hf-config", config, "--mesh", "fsdp=1").stdout)
    two = tmp_path / "t.json"
    two.write_text(cli("trainer-layout", "--hf-config", config, "--mesh", "fsdp=2").stdout)
    # The checkpoint to export: a save of random tensors (an HF directory).
    ckpt = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(5)
    with ws.Coordinator() as coord, \
            ws.Publisher(coordinator=coord.address, rank=0, layout=one) as pub:
        for p in one["params"]:
            pub.register(p["name"], torch.randn(p["global_shape"], generator=g)
                         .to(torch.bfloat16))
        total = pub.save_hf(ckpt, progress=False).total_bytes
    args = [ws.cli_path(), "export", "--checkpoint", ckpt, "--trainer", str(two),
            "--out", str(tmp_path / "out")]
    # Under a pseudo-terminal: the line is drawn; its last report is the
    # whole checkpoint.
    tty = subprocess.run(["script", "-qec", " ".join(args), "/dev/null"], capture_output=True,
                         text=True, timeout=300)
    assert tty.returncode == 0, tty.stdout + tty.stderr
    reports = re.findall(r"export: ([0-9.]+) / ([0-9.]+) MB", tty.stdout)
    assert reports, tty.stdout
    assert reports[-1] == (f"{total / 1e6:.1f}", f"{total / 1e6:.1f}"), reports
    # Not a terminal (or --json): nothing of it.
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    line = re.compile(r"export: [0-9.]+ / [0-9.]+ MB")
    assert not line.search(plain.stderr) and not line.search(plain.stdout), plain.stderr
