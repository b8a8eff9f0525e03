"""bench.hta_compare's vpipe side on small synthetic traces, without HTA (an optional extra
that CI does not install): the script prints vpipe's per-rank idle and one line on how to get
HTA's."""

from __future__ import annotations

import sys

import pytest

from bench import hta_compare
from vpipe.ir import actions_from_strings
from vpipe.trace.synth import write_synthetic_run

PROGRAMS = actions_from_strings(
    [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    ]
)


@pytest.fixture
def no_hta(monkeypatch):
    """HTA absent, whether or not this environment has it."""
    monkeypatch.setitem(sys.modules, "hta", None)
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", None)


@pytest.mark.parametrize("gpu", [False, True])
def test_vpipe_side_per_rank_without_hta(tmp_path, capsys, no_hta, gpu):
    write_synthetic_run(tmp_path / "run", PROGRAMS, steps=[0, 1], gpu=gpu)
    table = hta_compare.vpipe_idle(tmp_path / "run")
    assert list(table.index) == [0, 1]
    for r in table.itertuples():
        window, busy, idle = r[1], r[2], r[3]
        assert 0 < busy < window and idle == pytest.approx(window - busy)
        assert r[4] == pytest.approx(idle / window)
    device_busy = table["vpipe dev busy"]
    if gpu:  # the compute rows' device ops: at most the rows' own extent on the device
        assert (device_busy > 0).all() and (device_busy <= table["vpipe busy"] + 1e-9).all()
    else:
        assert device_busy.isna().all()

    assert hta_compare.main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f"python -m bench.hta_compare {tmp_path / 'run'}")  # what ran
    assert out[2] == f"{tmp_path / 'run'}:" and "vpipe bubble" in out[3] and "HTA" not in out[3]
    install = [line for line in out if line.startswith("HTA is not installed")]
    assert len(install) == 1 and "pip install 'vpipe[hta]'" in install[0]
    assert "HTA span: the rank's first GPU op to its last" in "\n".join(out)  # the definitions


def test_bad_directories_are_one_line_each(tmp_path, capsys, no_hta):
    with pytest.raises(SystemExit) as e:
        hta_compare.main([str(tmp_path / "nope")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("nope: not a directory of traces")
    (tmp_path / "empty").mkdir()
    write_synthetic_run(tmp_path / "run", PROGRAMS)
    assert hta_compare.main([str(tmp_path / "empty"), str(tmp_path / "run")]) == 1
    out, err = capsys.readouterr()
    assert err.strip().startswith(f"{tmp_path / 'empty'}: vpipe cannot read it: ")
    assert "\n" not in err.strip() and f"{tmp_path / 'run'}:" in out  # the others still read


def test_vpipe_never_imports_hta():
    """HTA is an optional extra for the bench script, not a dependency of the package."""
    import ast
    from pathlib import Path

    import vpipe

    for path in Path(vpipe.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            assert not any(n == "hta" or n.startswith("hta.") for n in names), path
