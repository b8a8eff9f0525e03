import pytest
from hypothesis import given
from hypothesis import strategies as st

from vpipe.ir import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    format_action,
    loop_placement,
    parse_action,
    v_placement,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0F0", Action(0, Kind.F, 0)),
        ("2I3", Action(2, Kind.I, 3)),
        ("3W1", Action(3, Kind.W, 1)),
        ("12B34", Action(12, Kind.B, 34)),
        ("1RECV_F0", Action(1, Kind.RECV_F, 0)),
        ("3SEND_B1", Action(3, Kind.SEND_B, 1)),
    ],
)
def test_parse_and_format_roundtrip(text, expected):
    assert parse_action(text) == expected
    assert format_action(expected) == text


def test_overlap_action():
    a = parse_action("(0F3;3B1)OVERLAP_F_B")
    assert a.kind is Kind.OVERLAP_F_B
    assert a.parts == (Action(0, Kind.F, 3), Action(3, Kind.B, 1))
    assert str(a) == "(0F3;3B1)OVERLAP_F_B"


@pytest.mark.parametrize(
    "bad",
    [
        "1F1B",
        "12F",
        "F0",
        "1X1",
        "",
        "0F",
        "-1F0",
        "0 F0",
        "(0F3)OVERLAP_F_B",
        "(0F3;1SEND_F0)OVERLAP_F_B",
        "\x00\x01",
    ],
)
def test_strict_parse_rejects(bad):
    with pytest.raises(ScheduleError) as err:
        parse_action(bad)
    assert "\n" not in str(err.value)


@given(
    st.integers(0, 10_000),
    st.sampled_from([k for k in Kind if k is not Kind.OVERLAP_F_B]),
    st.integers(0, 10_000),
)
def test_roundtrip_property(stage, kind, mb):
    a = Action(stage, kind, mb)
    assert parse_action(format_action(a)) == a


def test_placements():
    assert v_placement(4) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1, 7: 0}
    assert loop_placement(2, 4) == {0: 0, 1: 1, 2: 0, 3: 1}
    # zig-zag generalises to more chunks
    assert v_placement(2, 8) == {0: 0, 1: 1, 2: 1, 3: 0, 4: 0, 5: 1, 6: 1, 7: 0}
    with pytest.raises(ScheduleError):
        v_placement(4, 6)


def test_csv_roundtrip_skips_torch_idle_cells(tmp_path):
    text = "0F0,,0B0\n,1F0,1B0\n"
    s = Schedule.from_csv(text)
    assert s.n_ranks == 2 and s.n_stages == 2 and s.n_microbatches == 1
    assert s.placement == {0: 0, 1: 1}
    path = tmp_path / "s.csv"
    s.to_csv(path)
    assert Schedule.from_csv(path).actions == s.actions


def test_every_family_round_trips_through_csv_equal(tmp_path):
    """``==`` compares what the CSV format holds (the program), not how it was made: a
    generated schedule's name and meta (zbv's stages_per_rank, auto's search) are not in the
    file, so they do not make the read-back schedule differ; any action does."""
    from vpipe.schedules import make_schedule, schedule_names

    for name in schedule_names():
        s = make_schedule(name, 4, 8)
        path = tmp_path / f"{name}.csv"
        s.to_csv(path)
        back = Schedule.from_csv(path)
        assert back == s and back.name == name and back.meta == {} != s.meta
    zbv = make_schedule("zbv", 2, 4)
    swapped = [list(acts) for acts in zbv.actions]
    swapped[0][0], swapped[0][1] = swapped[0][1], swapped[0][0]
    assert zbv.replace_actions(swapped) != zbv
    assert zbv != make_schedule("zbv", 2, 6) and zbv != "zbv"


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", "empty file"),
        (b"\x00\x9f\x92\x96binary", "NUL"),
        (b"\xff\xfe\xfa", "UTF-8"),
        (b"0F0,1F1B\n", ":1: rank 0, cell 2"),
        (b"0F0\n0B0\n", "stage 0"),
    ],
)
def test_csv_errors_name_file_and_line(tmp_path, content, needle):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(ScheduleError) as err:
        Schedule.from_csv(path)
    assert needle in str(err.value)
    assert "bad.csv" in str(err.value)


def test_csv_skips_torch_fsdp_cells():
    s = Schedule.from_csv(
        "0UNSHARD,0F0,1SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD\n1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0,1RESHARD\n"
    )
    assert [str(a) for a in s.actions[0]] == ["0F0", "1SEND_F0", "0RECV_B0", "0B0"]
    assert s.is_lowered
