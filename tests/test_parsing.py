"""Answer parsing: validity, the last JSON list after </think>, inventory restriction, the guard."""

from __future__ import annotations

import pytest

from mistill.errors import MistillInputError
from mistill.evaluation.parsing import (
    CodeIndex,
    ascending_share,
    last_json_list,
    parse_answer,
    reasoning_closed,
    split_reasoning,
    undotted,
)

INVENTORY = ["N18.9", "I10", "E11.9", "J18.9", "K21.9"]


def test_plain_answer_after_think():
    ans = parse_answer('<think>Kidney: N18.9. Pressure: I10.</think>\n["N18.9", "I10"]', INVENTORY)
    assert ans.codes == ("N18.9", "I10")
    assert (ans.valid, ans.parsed, ans.reason) == (True, True, "ok")
    assert (ans.n_raw, ans.n_out_of_inventory, ans.n_malformed) == (2, 0, 0)
    assert not ans.degenerate and ans.degenerate_reason == ""


def test_lists_in_the_reasoning_are_ignored():
    gen = ('<think>Candidates: ["E11.9", "I10", "J18.9"]. Reject E11.9.</think>'
           'Final answer:\n["N18.9"]')
    assert parse_answer(gen, INVENTORY).codes == ("N18.9",)


def test_codes_in_the_reasoning_are_never_scraped():
    # closed reasoning that names a list, but no list after </think>: valid, empty, not parsed
    ans = parse_answer('<think>The answer is ["N18.9", "I10"]</think>I cannot decide.', INVENTORY)
    assert ans.codes == ()
    assert ans.valid and not ans.parsed and ans.reason == "no_json_list"


def test_unclosed_think_is_invalid_and_empty():
    ans = parse_answer('<think>So far ["N18.9"] and then I10, I10, I10', INVENTORY)
    assert ans.codes == () and not ans.valid and ans.reason == "unclosed_think"
    assert not ans.degenerate  # ended without the cap: invalid but not degenerate


def test_reopened_think_after_the_last_close_is_unclosed():
    ans = parse_answer('<think>a</think>["I10"]<think>more reasoning', INVENTORY)
    assert not ans.valid and ans.reason == "unclosed_think" and ans.codes == ()


def test_capped_generation_is_invalid_even_with_an_answer():
    ans = parse_answer('<think>x</think>["N18.9"]', INVENTORY, capped=True)
    assert ans.codes == () and not ans.valid and ans.reason == "capped"
    assert ans.degenerate and ans.degenerate_reason == "cap"


def test_no_think_tag_is_closed_reasoning_of_length_zero():
    ans = parse_answer('Codes: ["N18.9", "I10"]', INVENTORY)
    assert ans.valid and ans.codes == ("N18.9", "I10")
    assert split_reasoning('Codes: ["I10"]') == ("", 'Codes: ["I10"]')


def test_think_opened_by_the_prompt():
    # the chat template wrote <think>; the generation only closes it
    gen = 'I weigh ["E11.9"] here.</think>["I10"]'
    assert reasoning_closed(gen)
    assert parse_answer(gen, INVENTORY).codes == ("I10",)
    assert split_reasoning(gen) == ('I weigh ["E11.9"] here.', '["I10"]')


def test_last_of_several_lists_after_think_and_code_fences():
    gen = '<think>r</think>Draft ["I10"]\nFinal:\n```json\n["N18.9", "I10"]\n```\n'
    assert parse_answer(gen, INVENTORY).codes == ("N18.9", "I10")


def test_undecodable_bracket_after_the_list_is_skipped():
    gen = '<think>r</think>["N18.9"] [see note above]'
    assert parse_answer(gen, INVENTORY).codes == ("N18.9",)


def test_outer_list_wins_over_nested_list():
    assert last_json_list('x [["N18.9"], "I10"] y') == [["N18.9"], "I10"]
    ans = parse_answer('</think>[["N18.9"], "I10"]', INVENTORY)
    assert ans.codes == ("I10",) and ans.n_malformed == 1 and ans.n_raw == 2


def test_inventory_restriction_dedup_and_counts():
    gen = '<think>r</think>["N18.9", "N18.9", "Z99.99", 5, null, "I10", " I10 "]'
    ans = parse_answer(gen, INVENTORY)
    # 7 entries: 2 non-strings, 1 out of inventory, N18.9 and I10 repeated
    assert ans.codes == ("N18.9", "I10")
    assert (ans.n_raw, ans.n_out_of_inventory, ans.n_malformed) == (7, 1, 2)


def test_empty_list_is_a_parsed_empty_answer():
    ans = parse_answer("<think>r</think>[]", INVENTORY)
    assert ans.valid and ans.parsed and ans.codes == () and ans.reason == "ok"


def test_json_but_not_a_list():
    assert parse_answer('<think>r</think>{"code": "N18.9"}', INVENTORY).reason == "not_a_list"
    assert parse_answer('<think>r</think>"N18.9"', INVENTORY).reason == "not_a_list"
    assert parse_answer("<think>r</think>N18.9", INVENTORY).reason == "no_json_list"


def test_normalize_matches_dotted_and_undotted_in_inventory_spelling():
    gen = '</think>["N189", "n18.9", "e119", "I10"]'
    assert parse_answer(gen, INVENTORY).codes == ("I10",)  # exact match only
    assert parse_answer(gen, INVENTORY, normalize=undotted).codes == ("N18.9", "E11.9", "I10")
    index = CodeIndex(INVENTORY, undotted)
    assert len(index) == 5 and index.lookup("k219") == "K21.9" and index.lookup("X00") is None
    assert parse_answer(gen, index).codes == ("N18.9", "E11.9", "I10")
    with pytest.raises(MistillInputError):
        parse_answer(gen, index, normalize=str.upper)


def test_split_reasoning_unclosed_and_closed():
    assert split_reasoning("pre<think>abc") == ("abc", "")
    assert split_reasoning("<think>abc</think> [1]") == ("abc", " [1]")


# Degenerate guard --------------------------------------------------------------------------

ASC = [f"E{i}.9" for i in range(10, 80)]  # 70 codes, ascending in code order


def _gen(codes):
    return "<think>r</think>[" + ", ".join(f'"{c}"' for c in codes) + "]"


def test_ascending_share_hand_values():
    assert ascending_share(("B", "A", "C")) == 0.5  # pairs (B,A) no, (A,C) yes
    assert ascending_share(("A10.0", "A101")) == 1.0  # compared undotted: A100 < A101
    assert ascending_share(("A",)) == 0.0


def test_ten_sorted_codes_are_degenerate_nine_are_not():
    ans = parse_answer(_gen(ASC[:10]), ASC)  # 9/9 pairs ascending
    assert ans.degenerate and ans.degenerate_reason == "ascending" and ans.valid
    assert len(ans.codes) == 10  # still scored
    assert not parse_answer(_gen(ASC[:9]), ASC).degenerate  # fewer than 10 codes


def test_ascending_share_threshold_is_strict():
    ten = ASC[:10]
    one_descent = ten[:4] + [ten[5], ten[4]] + ten[6:]  # 8 of 9 pairs ascending = 0.889
    assert not parse_answer(_gen(one_descent), ASC).degenerate
    twenty = ASC[:20]
    one_descent20 = twenty[:4] + [twenty[5], twenty[4]] + twenty[6:]  # 18/19 = 0.947 > 0.9
    assert parse_answer(_gen(one_descent20), ASC).degenerate_reason == "ascending"


def test_more_than_fifty_codes_is_degenerate():
    desc = ASC[::-1]  # descending, so the ascending rule does not apply
    assert parse_answer(_gen(desc[:51]), ASC).degenerate_reason == "too_many_codes"
    assert not parse_answer(_gen(desc[:50]), ASC).degenerate


def test_guard_counts_scored_codes_after_dedup():
    # 60 copies of one code are one scored code: not flagged by the count rule
    ans = parse_answer(_gen(["I10"] * 60), INVENTORY)
    assert ans.codes == ("I10",) and ans.n_raw == 60 and not ans.degenerate
