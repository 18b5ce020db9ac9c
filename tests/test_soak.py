"""``python -m ds_q8.tools.soak`` with tiny settings: the table, the JSON, and the verdict."""
import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from ds_q8.tools import soak
from ds_q8.optim import step as S

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_soak_command_writes_json_and_passes(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "ds_q8.tools.soak", "--steps", "120", "--warmup", "20", "--every", "40",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert [row["step"] for row in r["rows"]] == [40, 80, 120]
    assert r["ok"] and r["max_abs_diff"] == 0.0 and r["rss_growth"] < 0.01
    assert "max |kernel - reference|" in proc.stdout and "OK" in proc.stdout


def test_drift_is_detected():
    # a "kernel" that updates differently from the reference must show up as drift
    real = S.fused_step_many

    def off_by_a_bit(o, items, gr, h, **kw):
        rest = real(o, items, gr, h, **kw)
        if S.group_impl(gr) != "reference":  # the reference copy keeps the real path
            for item in items:
                item[0].data.add_(1e-3)
        return rest

    with mock.patch("ds_q8.optim.step.fused_step_many", side_effect=off_by_a_bit):
        r = soak.run(steps=4, warmup=1, every=2, width=32, batch=4, seed=0, log=lambda _: None)
    assert r["kernel"] and r["max_abs_diff"] > 0


def test_bad_arguments_name_the_flag(capsys):
    for argv, flag in [(["--steps", "0"], "--steps"), (["--steps", "10", "--warmup", "10"], "--warmup")]:
        with pytest.raises(SystemExit) as e:
            soak.main(argv)
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
