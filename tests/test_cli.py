"""The schedule commands of the ``vpipe`` CLI: schedules, show, validate, simulate, compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vpipe.cli import main
from vpipe.commands._grid import styled_grid
from vpipe.ir import Schedule
from vpipe.ir.lowering import lower
from vpipe.schedules import make_schedule, schedule_names
from vpipe.sim import CostModel, simulate

REPO = Path(__file__).resolve().parents[1]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; argparse's exits count as return codes."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def grid_rows(out: str) -> dict[int, list[str]]:
    """rank -> cells, from an unwrapped ``vpipe show`` grid."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("rank "):
            head, _, body = line.partition(" | ")
            rows[int(head.split()[1])] = body.split()
    return rows


# ---------------------------------------------------------------------------------------------
# schedules, show


def test_schedules_lists_every_name_with_description(capsys):
    rc, out, err = run(["schedules"], capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    names = schedule_names()
    assert len(lines) == len(names)
    for line, (name, text) in zip(lines, names.items(), strict=True):
        assert line.split()[0] == name
        assert line.rstrip().endswith(text)


def test_show_aligns_actions_by_unit_time(capsys):
    rc, out, _ = run(
        ["show", "1f1b", "--ranks", "2", "--microbatches", "2", "--width", "500"], capsys
    )
    assert rc == 0
    rows = grid_rows(out)
    assert sorted(rows) == [0, 1]
    # f = 1, B = b + w = 2 slots: rank 1 starts one slot after rank 0 and runs F then B at once.
    assert rows[0][:2] == ["0F0", "0F1"]
    assert rows[1][:4] == [".", "1F0", "1B0", "-"]
    # every compute action appears exactly once
    s = make_schedule("1f1b", 2, 2)
    for r in range(2):
        labels = [c for c in rows[r] if c not in (".", "-")]
        assert labels == [str(a) for a in s.actions[r]]


def test_show_overlap_actions_compactly(capsys):
    rc, out, _ = run(
        ["show", "dualpipev", "--ranks", "2", "--microbatches", "8", "--width", "900"], capsys
    )
    assert rc == 0
    cells = [c for row in grid_rows(out).values() for c in row]
    s = make_schedule("dualpipev", 2, 8)
    overlaps = [a for _, _, a in s.iter_actions() if len(a.compute_parts()) > 1]
    assert overlaps, "dualpipev at P=2, M=8 should overlap some F and B"
    for a in overlaps:
        assert "+".join(str(p) for p in a.parts) in cells


def test_show_wraps_to_width(capsys):
    rc, out, _ = run(
        ["show", "gpipe", "--ranks", "4", "--microbatches", "8", "--width", "60"], capsys
    )
    assert rc == 0
    assert max(len(line) for line in out.splitlines()[2:]) <= 60
    rank0_lines = [line for line in out.splitlines() if line.startswith("rank 0 ")]
    assert len(rank0_lines) > 1


def test_show_lowered_lists_program_order(capsys):
    rc, out, _ = run(
        ["show", "zbv", "--ranks", "2", "--microbatches", "4", "--lowered", "--width", "2000"],
        capsys,
    )
    assert rc == 0
    lowered = lower(make_schedule("zbv", 2, 4))
    rows = grid_rows(out)
    for r in range(2):
        assert rows[r] == [str(a) for a in lowered.actions[r]]
    assert any("SEND_F" in c for c in rows[0])


def test_show_writes_torch_csv(tmp_path, capsys):
    compute, lowered = tmp_path / "c.csv", tmp_path / "l.csv"
    args = ["show", "interleaved-1f1b", "--ranks", "2", "--microbatches", "4"]
    assert run([*args, "--csv", str(compute)], capsys)[0] == 0
    assert run([*args, "--lowered", "--csv", str(lowered)], capsys)[0] == 0
    s = make_schedule("interleaved-1f1b", 2, 4)
    assert compute.read_text() == s.to_csv()
    assert lowered.read_text() == lower(s).to_csv()


def test_show_accepts_a_csv_file(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    make_schedule("zb-h1", 2, 4).to_csv(path)
    rc, out, _ = run(["show", str(path), "--width", "1000"], capsys)
    assert rc == 0
    assert out.startswith("mine: 2 ranks, 2 stages, 4 microbatches, placement loop")
    assert sorted(grid_rows(out)) == [0, 1]


def test_grid_colours_by_kind():
    """On a terminal the grid is coloured (piped output, as in these tests, stays plain)."""
    text = styled_grid("rank 0 | 0F0 0B0 - 0W0 2I1 1SEND_F0 0F1+3B0")
    styles = {text.plain[span.start : span.end]: str(span.style) for span in text.spans}
    assert styles["0F0"] == "green" and styles["0W0"] == "yellow"
    assert styles["0B0"] == styles["2I1"] == "cyan"
    assert styles["1SEND_F0"] == "dim" and styles["0F1+3B0"] == "magenta"


# ---------------------------------------------------------------------------------------------
# validate


def test_validate_compute_only_and_lowered(tmp_path, capsys):
    s = make_schedule("zbv", 4, 8)
    compute, lowered = tmp_path / "c.csv", tmp_path / "l.csv"
    s.to_csv(compute)
    lower(s).to_csv(lowered)

    rc, out, err = run(["validate", str(compute)], capsys)
    assert (rc, err) == (0, "")
    assert out.strip() == "valid: 4 ranks, 8 stages, 8 microbatches, placement v"

    rc, out, _ = run(["validate", str(lowered), "--lowered"], capsys)
    assert rc == 0 and out.startswith("valid: 4 ranks, 8 stages, 8 microbatches, placement v")

    rc, _, err = run(["validate", str(lowered)], capsys)
    assert rc == 2 and "--lowered" in err and err.count("\n") == 1

    rc, _, err = run(["validate", str(compute), "--lowered"], capsys)
    assert rc == 2 and "no SEND/RECV" in err and err.count("\n") == 1


def test_validate_names_the_broken_action(tmp_path, capsys):
    s = make_schedule("1f1b", 3, 4)
    rows = s.to_rows()
    rows[1].remove("1B2")  # stage 1 never runs the backward of microbatch 2
    path = tmp_path / "broken.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    rc, out, err = run(["validate", str(path)], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "rank 1" in err


def test_validate_reordered_receives_fail(tmp_path, capsys):
    lowered = lower(make_schedule("1f1b", 2, 4))
    rows = lowered.to_rows()
    recvs = [i for i, c in enumerate(rows[1]) if "RECV_F" in c]
    i, j = recvs[0], recvs[1]
    rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
    path = tmp_path / "swapped.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    rc, _, err = run(["validate", str(path), "--lowered"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "rank" in err


# ---------------------------------------------------------------------------------------------
# simulate


def test_simulate_json_matches_the_simulator(capsys):
    rc, out, err = run(
        ["simulate", "1f1b", "--ranks", "4", "--microbatches", "8", "--json"], capsys
    )
    assert rc == 0 and err == ""
    data = json.loads(out)
    ref = simulate(make_schedule("1f1b", 4, 8), CostModel.parse("f=1,b=1,w=1,comm=0"))
    assert data["makespan"] == pytest.approx(ref.makespan)
    assert data["bubble_ratio"] == pytest.approx(ref.bubble_ratio)
    # closed form for 1F1B with f = b = w = 1 and free comm: (P-1)/(M+P-1)
    assert data["bubble_ratio"] == pytest.approx(3 / 11)
    assert data["bubble_ratio_per_rank"] == pytest.approx(list(ref.bubble_ratio_per_rank))
    assert data["peak_stage_activations"] == [4, 3, 2, 1]
    assert data["comm_ops"] == list(ref.comm_ops) and len(data["comm_ops"]) == 4


def test_simulate_cost_changes_result_and_trace_is_written(tmp_path, capsys):
    trace = tmp_path / "t.json"
    base = ["simulate", "zbv", "--ranks", "2", "--microbatches", "4", "--json"]
    rc, out, _ = run(base, capsys)
    slow = json.loads(out)["makespan"]
    rc, out, _ = run([*base, "--cost", "f=2,b=2,w=2,comm=0", "--trace", str(trace)], capsys)
    assert rc == 0
    assert json.loads(out)["makespan"] == pytest.approx(2 * slow)
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    assert {"0F0", "3I0", "3W0", "0SEND_F0"} <= names


def test_simulate_text_summary_and_csv_input(tmp_path, capsys):
    path = tmp_path / "s.csv"
    make_schedule("gpipe", 2, 3).to_csv(path)
    rc, out, _ = run(["simulate", str(path), "--ranks", "2", "--microbatches", "3"], capsys)
    assert rc == 0
    assert "makespan" in out and "bubble ratio" in out
    assert sum(1 for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])) == 2


# ---------------------------------------------------------------------------------------------
# compare


def test_compare_json_has_a_row_per_schedule(capsys):
    rc, out, _ = run(["compare", "--ranks", "4", "--microbatches", "8", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    rows = {row["schedule"]: row for row in data["schedules"]}
    assert list(rows) == list(schedule_names())
    # Same model for every schedule: with V stages per rank a stage costs 1/V.
    # Closed forms (P=4, M=8, f=b=w=1 per rank share): 1F1B (M+P-1)*3,
    # interleaved 3M + (P-1)*3/V, zb-h1 3M + (P-1)*(f+b-w).
    assert rows["1f1b"]["makespan"] == pytest.approx(33)
    assert rows["interleaved-1f1b"]["makespan"] == pytest.approx(24 + 9 / 2)
    assert rows["zb-h1"]["makespan"] == pytest.approx(27)
    assert rows["1f1b"]["relative_step_time"] == pytest.approx(33 / 28.5)
    assert rows["interleaved-1f1b"]["relative_step_time"] == pytest.approx(1.0)
    for name, row in rows.items():
        assert "error" not in row, row
        s = make_schedule(name, 4, 8)
        v = s.stages_per_rank
        ref = simulate(s, CostModel(f=1 / v, b=1 / v, w=1 / v))
        assert row["makespan"] == pytest.approx(ref.makespan)
        assert row["bubble_ratio"] == pytest.approx(ref.bubble_ratio)
        assert row["peak_activation_units_max"] == pytest.approx(max(ref.peak_stage_activations) / v)
        assert row["comm_ops_total"] == sum(ref.comm_ops)


def test_compare_reports_unsupported_sizes_in_the_row(capsys):
    argv = ["compare", "--ranks", "4", "--microbatches", "3", "--stages-per-rank", "2"]
    rc, out, _ = run([*argv, "--schedules", "gpipe,interleaved-1f1b,zbv"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[1].split()[0] == "schedule"
    body = {line.split()[0]: line for line in lines[2:-1]}
    assert list(body) == ["gpipe", "interleaved-1f1b", "zbv"]
    assert "cannot run" in body["gpipe"] and "1 stage per rank" in body["gpipe"]
    assert "cannot run" not in body["interleaved-1f1b"] and "cannot run" not in body["zbv"]


def test_compare_text_table(capsys):
    rc, out, _ = run(["compare", "--schedules", "1f1b,interleaved-1f1b"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("4 ranks, 8 microbatches")
    assert "bubble excl. skew" in lines[1]
    assert [line.split()[0] for line in lines[2:4]] == ["1f1b", "interleaved-1f1b"]
    assert lines[2].split()[-1] == f"{33 / 28.5:.3f}" and lines[3].split()[-1] == "1.000"
    assert lines[4].startswith("(one model split into")


# ---------------------------------------------------------------------------------------------
# bad input: one line on stderr, non-zero exit, no traceback


def _files(tmp_path: Path) -> dict[str, Path]:
    good = make_schedule("1f1b", 2, 2)
    files = {
        "junk.csv": bytes(range(256)) * 4,
        "empty.csv": b"",
        "blank.csv": b"\n\n \n",
        "badcell.csv": b"0F0,0F1B,0B0\n1F0,1B0\n",
        "latin1.csv": "0F0,0B0\n1F\xe9,1B0\n".encode("latin-1"),
        "missing_b.csv": b"0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n",
        "twostage.csv": b"0F0,1F0,1B0,0B0\n0F1\n",
        "good.csv": good.to_csv().encode(),
    }
    out = {}
    for name, data in files.items():
        out[name.removesuffix(".csv")] = path = tmp_path / name
        path.write_bytes(data)
    return out


BAD_ARGV = [
    ["validate", "{junk}"],
    ["validate", "{empty}"],
    ["validate", "{blank}"],
    ["validate", "{badcell}"],
    ["validate", "{latin1}"],
    ["validate", "{missing_b}"],
    ["validate", "{twostage}"],
    ["validate", "{tmp}/does-not-exist.csv"],
    ["validate", "{tmp}"],
    ["simulate", "{good}", "--ranks", "3"],
    ["simulate", "{good}", "--microbatches", "5"],
    ["show", "{good}", "--stages-per-rank", "2"],
    ["show", "no-such-schedule", "--ranks", "2", "--microbatches", "2"],
    ["show", "gp\x00ipe", "--ranks", "2", "--microbatches", "2"],
    ["show", "gpipe", "--ranks", "2"],
    ["show", "gpipe", "--ranks", "0", "--microbatches", "2"],
    ["show", "gpipe", "--ranks", "abc", "--microbatches", "2"],
    ["show", "gpipe", "--ranks", "-3", "--microbatches", "2"],
    ["show", "zbv", "--ranks", "2", "--microbatches", "4", "--stages-per-rank", "3"],
    ["show", "gpipe", "--ranks", "100000", "--microbatches", "100000"],
    ["simulate", "gpipe", "--ranks", "2", "--microbatches", "2", "--cost", "nonsense"],
    ["simulate", "gpipe", "--ranks", "2", "--microbatches", "2", "--cost", "f=abc"],
    ["simulate", "gpipe", "--ranks", "2", "--microbatches", "2", "--cost", "f=-1"],
    ["simulate", "gpipe", "--ranks", "2", "--microbatches", "2", "--cost", "zzz=1"],
    ["compare", "--schedules", "gpipe,nope"],
    ["compare", "--schedules", "gpipe,,zbv"],
    ["compare", "--cost", "f=1,b="],
    ["show", "gpipe", "--ranks", "2", "--microbatches", "2", "--csv", "{junk}/x.csv"],
    ["simulate", "gpipe", "--ranks", "2", "--microbatches", "2", "--trace", "{junk}/t.json"],
]


@pytest.mark.parametrize("argv", BAD_ARGV, ids=lambda a: " ".join(a)[:60])
def test_bad_input_gives_one_line_error(tmp_path, capsys, argv):
    files = _files(tmp_path)
    fill = {name: str(path) for name, path in files.items()} | {"tmp": str(tmp_path)}
    argv = [a.format(**fill) for a in argv]
    rc, out, err = run(argv, capsys)
    assert rc != 0
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "error" in err and "Traceback" not in err


def test_bad_input_in_a_real_process(tmp_path):
    """The same through ``python -m vpipe``: one stderr line, no traceback."""
    files = _files(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cases = [
        (["validate", str(files["junk"])], "NUL"),
        (["simulate", "zbv", "--ranks", "2", "--microbatches", "4", "--cost", "f=x"], "f=x"),
        (["show", "gpipe", "--ranks", "two", "--microbatches", "2"], "--ranks"),
    ]
    for argv, needle in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "vpipe", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode != 0, argv
        assert proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr and needle in proc.stderr


def test_compare_in_a_real_process():
    """What ``make bench`` runs."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "vpipe", "compare", "--ranks", "4", "--microbatches", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines()[2:-1]]
    assert names == list(schedule_names())


def test_schedule_from_csv_roundtrip_through_show(tmp_path, capsys):
    """A CSV written by ``show --csv`` reads back as the same schedule."""
    path = tmp_path / "z.csv"
    assert (
        run(["show", "zbv", "--ranks", "3", "--microbatches", "6", "--csv", str(path)], capsys)[0]
        == 0
    )
    s = Schedule.from_csv(path)
    ref = make_schedule("zbv", 3, 6)
    assert s.actions == ref.actions and s.placement == ref.placement


def test_command_module_does_not_import_torch():
    code = "import sys, vpipe.commands.schedule; print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.stdout.strip() == "False", proc.stderr


def test_stages_per_rank_reaches_the_generator(capsys):
    argv = ["interleaved-1f1b", "--ranks", "2", "--microbatches", "4", "--stages-per-rank", "3"]
    rc, out, _ = run(["simulate", *argv, "--json"], capsys)
    assert rc == 0 and json.loads(out)["stages"] == 6
    rc, out, _ = run(["show", *argv], capsys)
    assert rc == 0 and out.startswith("interleaved-1f1b: 2 ranks, 6 stages, 4 microbatches")


TOKENS = ["0F0", "0F1", "1F0", "1F1", "0B0", "1B1", "0I0", "0W0", "1I1", "1W1", "2F0"]
TOKENS += ["0SEND_F0", "1RECV_F0", "1SEND_B0", "0RECV_B0", "(0F1;1B0)OVERLAP_F_B", "", "x"]


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(st.lists(st.sampled_from(TOKENS), max_size=8), min_size=1, max_size=3),
    lowered=st.booleans(),
)
def test_arbitrary_csv_never_crashes(tmp_path, capsys, rows, lowered):
    """Any mix of valid and invalid cells: exit 0 with the valid line, or 2 with one line."""
    path = tmp_path / "fuzz.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    rc, out, err = run(["validate", str(path), *(["--lowered"] if lowered else [])], capsys)
    if rc == 0:
        assert out.startswith("valid: ") and err == ""
    else:
        assert rc == 2 and out == "" and err.count("\n") == 1, err


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(tmp_path, capsys, data):
    path = tmp_path / "bytes.csv"
    path.write_bytes(data)
    rc, out, err = run(["simulate", str(path)], capsys)
    assert rc in (0, 2)
    assert rc == 0 or (out == "" and err.count("\n") == 1), err
