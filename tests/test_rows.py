"""Supervised rows across tokenizers: pairing by event id, window rows by token distance,
the trace-start guard, and the coverage table (Table 38's structure) with a digit-merging
student tokenizer."""

from __future__ import annotations


import pytest

from mistill.distill.rows import SupervisedRow, coverage_table, rows_by_phase, supervised_rows
from mistill.errors import MistillInputError
from mistill.instrument.events import extract_events, realize_events

CODES = ["N18.1", "N18.9", "N18.30", "N17.9", "N28.9", "E11.9", "E11.65", "I10", "J18.9"]
TEACHER_PROMPT = "<|im_start|>user\nCode this note.<|im_end|>\n<|im_start|>assistant\n"
STUDENT_PROMPT = "User: code it.\nAssistant: "


def wrap(body: str, answer: str = "[]") -> str:
    return f"<think>\n{body}\n</think>\n\n{answer}"


TRACES = {
    "m1": wrap("Consider E11.9 then N18.1 or N18.9 and E11.65; also J18.9. The kidney findings "
               "are long standing and the stage is not written anywhere in the note."),
    "m2": wrap("Consider E11.9 then E11.65 here."),
}


@pytest.fixture(scope="module")
def smol():
    from mistill.models.loading import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="module")
def merging():
    from tok_fixtures import merging_tokenizer

    return merging_tokenizer()


def realize(tokenizer, prompt: str, note_id: str, *, n_null: int = 0):
    trace = TRACES[note_id]
    events = extract_events(note_id, trace, CODES, n_null=n_null)
    full = prompt + trace
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    rel = realize_events(events, full_text=full, trace_offset=len(prompt), tokenizer=tokenizer,
                         input_ids=enc["input_ids"], offsets=enc["offset_mapping"], codes=CODES)
    start = next(i for i, (s, _) in enumerate(enc["offset_mapping"]) if s >= len(prompt))
    return events, rel, start


def test_same_tokenizer_pairs_every_event_and_identical_distances(smol):
    events, rel, start = realize(smol, TEACHER_PROMPT, "m1", n_null=4)
    assert any(e.kind == "NULL" for e in events)
    rows = supervised_rows(rel, rel, teacher_trace_start=start, student_trace_start=start)
    code_events = [r for r in rel if r.event.kind != "NULL"]
    ev_rows = [r for r in rows if r.role == "event"]
    assert sorted(r.event_id for r in ev_rows) == sorted(r.event.event_id for r in code_events)
    assert {r.phase for r in rows} == {"P1", "P2", "P2C"}  # NULL never supervised
    by_id = {r.event.event_id: r for r in rel}
    for row in rows:
        assert row.teacher_pos == row.student_pos
        assert row.teacher_pos == by_id[row.event_id].position - row.distance
        assert row.note_id == "m1"
    p1 = [r for r in code_events if r.event.kind == "P1"]
    win = [r for r in rows if r.role == "window"]
    assert all(r.phase == "P1" for r in win)
    # the first P1 sits 4 tokens into the trace ("<think>\nConsider" then " E"): 4 window rows
    room = [min(8, r.position - start) for r in p1]
    assert room == [4, 8, 8, 8, 8] and len(win) == sum(room)
    for r, n in zip(p1, room):
        assert sorted(w.distance for w in win if w.event_id == r.event.event_id) == \
            list(range(1, n + 1))
    keys = [(r.student_pos, r.role) for r in rows]
    assert keys == sorted(keys)
    groups = rows_by_phase(rows)
    assert len(groups["P1_window"]) == len(win)
    assert len(groups["P1"]) == len(p1) and sum(map(len, groups.values())) == len(rows)
    assert supervised_rows(rel, rel, window=0, teacher_trace_start=start,
                           student_trace_start=start) == ev_rows


def test_merged_digit_runs_drop_rows_and_coverage_counts_them(smol, merging):
    teacher, student, rows = {}, {}, {}
    for nid in TRACES:
        events, t_rel, t_start = realize(smol, TEACHER_PROMPT, nid)
        _, s_rel, s_start = realize(merging, STUDENT_PROMPT, nid)
        # the teacher (SmolLM2: one digit per token) realizes every extracted event
        assert len(t_rel) == len(events)
        teacher[nid], student[nid] = t_rel, s_rel
        rows[nid] = supervised_rows(t_rel, s_rel, teacher_trace_start=t_start,
                                    student_trace_start=s_start)
        t_by = {r.event.event_id: r for r in t_rel}
        s_by = {r.event.event_id: r for r in s_rel}
        ev_rows = {r.event_id for r in rows[nid] if r.role == "event"}
        assert ev_rows == set(t_by) & set(s_by)
        for row in rows[nid]:
            assert row.teacher_pos == t_by[row.event_id].position - row.distance
            assert row.student_pos == s_by[row.event_id].position - row.distance
            assert row.teacher_pos >= t_start and row.student_pos >= s_start
    # the dropped events are the decisions inside the merged runs "18" and "65"
    dropped = [(e.kind, e.code, e.char_index) for e in (r.event for r in teacher["m1"])
               if e.event_id not in {r.event_id for r in rows["m1"]}]
    assert dropped == [("P2", "N18.1", 2), ("P2", "N18.9", 2), ("P2", "E11.65", 4),
                       ("P2C", "E11.65", 4)]
    table = coverage_table(teacher, student)
    assert list(table.index) == ["P1", "P2", "P2C", "all"]
    got = table[["teacher_events", "student_realized", "notes", "notes_zero"]].to_dict("index")
    # m1: P1 5/5, P2 5/8, P2C 1/2; m2: P1 2/2, P2 1/2 (E11.65's '6' opens "65"), P2C 0/1
    assert got == {"P1": {"teacher_events": 7, "student_realized": 7, "notes": 2,
                          "notes_zero": 0},
                   "P2": {"teacher_events": 10, "student_realized": 6, "notes": 2,
                          "notes_zero": 0},
                   "P2C": {"teacher_events": 3, "student_realized": 1, "notes": 2,
                           "notes_zero": 1},
                   "all": {"teacher_events": 20, "student_realized": 14, "notes": 2,
                           "notes_zero": 0}}
    assert table.loc["P1", "share"] == 1.0 and table.loc["P2", "share"] == pytest.approx(0.6)
    assert table.loc["P2C", "share"] == pytest.approx(1 / 3)
    assert table.loc["P2", "median_note_share"] == pytest.approx((5 / 8 + 1 / 2) / 2)
    assert table.loc["P2C", "median_note_share"] == pytest.approx(0.25)
    assert table.loc["all", "median_note_share"] == pytest.approx((11 / 15 + 3 / 5) / 2)
    # the same tokenizer keeps everything
    same = coverage_table(teacher, teacher)
    assert (same["share"] == 1.0).all() and (same["notes_zero"] == 0).all()
    with pytest.raises(MistillInputError) as exc:
        coverage_table(teacher, {"m1": student["m1"]})
    assert exc.value.note == "m2"


def test_window_rows_never_precede_the_trace_start(smol, merging):
    TRACES["early"] = wrap("N18.9 first, then the long kidney story and E11.9.")
    try:
        _, t_rel, t_start = realize(smol, TEACHER_PROMPT, "early")
        _, s_rel, s_start = realize(merging, STUDENT_PROMPT, "early")
    finally:
        del TRACES["early"]
    first_t = next(r for r in t_rel if r.event.kind == "P1")
    first_s = next(r for r in s_rel if r.event.event_id == first_t.event.event_id)
    room_t, room_s = first_t.position - t_start, first_s.position - s_start
    assert 0 < min(room_t, room_s) < 8 and room_t != room_s  # the guard binds, differently
    rows = supervised_rows(t_rel, s_rel, teacher_trace_start=t_start,
                           student_trace_start=s_start)
    win = [r for r in rows if r.role == "window"]
    assert all(r.teacher_pos >= t_start and r.student_pos >= s_start for r in win)
    first = sorted(r.distance for r in win if r.event_id == first_t.event.event_id)
    assert first == list(range(1, min(room_t, room_s) + 1))
    second = [r for r in win if r.event_id != first_t.event.event_id]
    assert sorted(r.distance for r in second) == list(range(1, 9))
    # the same rows with the whole text as "trace": nothing is cut
    all_rows = supervised_rows(t_rel, s_rel, teacher_trace_start=0, student_trace_start=0)
    assert len([r for r in all_rows if r.role == "window"]) == 16


def test_row_records_and_inputs_are_checked(smol):
    with pytest.raises(MistillInputError):
        SupervisedRow("n", "NULL", "event", "n:NULL:0", 0, 3, 3)
    with pytest.raises(MistillInputError):
        SupervisedRow("n", "P1", "window", "n:P1:0", 0, 3, 3)
    with pytest.raises(MistillInputError):
        SupervisedRow("n", "P1", "event", "n:P1:0", 2, 3, 3)
    _, m1, start = realize(smol, TEACHER_PROMPT, "m1")
    _, m2, _ = realize(smol, TEACHER_PROMPT, "m2")
    with pytest.raises(MistillInputError) as exc:  # two notes in one call
        supervised_rows(m1, m2, teacher_trace_start=start, student_trace_start=start)
    assert exc.value.field == "note_id"
    with pytest.raises(MistillInputError) as exc:  # one event realized twice
        supervised_rows(m1 + m1[:1], m1, teacher_trace_start=start, student_trace_start=start)
    assert exc.value.field == "event_id"
