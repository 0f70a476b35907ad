"""BigCodeBench: the release's JSONL, import aliases, qualified API-naming events, code answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mistill.errors import MistillInputError
from mistill.instrument.events import extract_events
from mistill.tasks import task
from mistill.tasks.bigcodebench import import_aliases, load_bigcodebench

CODE_PROMPT = "import numpy as np\nimport random\nfrom matplotlib import pyplot as plt\ndef task_func(data):\n"


def _problem(tid: str, **over):
    row = {"task_id": tid,
           "complete_prompt": CODE_PROMPT + '    """Mean and median of data.\n    >>> task_func([1, 2])\n    """\n',
           "instruct_prompt": "Compute the mean and median with numpy; plot the data with matplotlib.",
           "canonical_solution": "    plt.plot(data)\n    return np.mean(data), np.median(data)\n",
           "code_prompt": CODE_PROMPT, "test": "import unittest\n", "entry_point": "task_func",
           "libs": "['numpy', 'random', 'matplotlib']", "doc_struct": "{}"}
    row.update(over)
    return row


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_loader_aliases_and_inventory(tmp_path):
    probs = load_bigcodebench(_write(tmp_path / "bcb.jsonl", [_problem("BigCodeBench/7"),
                                                             _problem("BigCodeBench/8", libs=["numpy"])]))
    p = probs[0]
    assert p.libs == ("numpy", "random", "matplotlib") and probs[1].libs == ("numpy",)
    assert p.aliases == {"np": "numpy", "random": "random", "plt": "matplotlib.pyplot"}
    assert p.items == {"matplotlib.pyplot.plot": "plot of matplotlib.pyplot", "numpy.mean": "mean of numpy",
                       "numpy.median": "median of numpy"}
    assert import_aliases("import os.path, json as js\nfrom collections import Counter as C, deque\n"
                          "from . import sibling\n") == {"os": "os", "js": "json", "C": "collections.Counter",
                                                          "deque": "collections.deque"}


@pytest.mark.parametrize("over, field", [({"libs": "numpy"}, "libs"), ({"code_prompt": None}, "code_prompt"),
                                         ({"libs": [1]}, "libs"), ({"canonical_solution": ""}, "canonical_solution")])
def test_loader_errors_name_file_record_and_field(tmp_path, over, field):
    path = _write(tmp_path / "bcb.jsonl", [_problem("BigCodeBench/7"), _problem("BigCodeBench/9", **over)])
    with pytest.raises(MistillInputError) as exc:
        load_bigcodebench(path)
    assert (exc.value.file, exc.value.line, exc.value.note, exc.value.field) == (str(path), 2, "BigCodeBench/9", field)


def test_api_naming_events_by_hand(tmp_path):
    p = load_bigcodebench(_write(tmp_path / "bcb.jsonl", [_problem("BigCodeBench/7")]))[0]
    t = p.task()
    trace = ("<think>\nnp.median first? No: numpy.mean fits, then plt.plot.\n</think>\n\n"
             "```python\nimport numpy as np\ndef task_func(data):\n    return np.mean(data)\n```")
    ev = extract_events(p.task_id, trace, list(p.items), task=t, n_null=0)
    m1, m2, m4 = trace.index("np.median"), trace.index("numpy.mean"), trace.index("np.mean(")
    s1, s2 = (m1, m1 + 9), (m2, m2 + 10)
    assert [(e.kind, e.code, e.anchor, e.target, e.competitors, e.near_miss, e.S, e.N) for e in ev] == [
        # written through the alias: only ".median" is the item's own text; 'd' against 'a' (mean)
        ("P2", "numpy.median", m1 + 5, "d", ("a",), None, (), ()),
        # written in full: the first character picks the module ('n' against matplotlib's 'm')
        ("P2", "numpy.mean", m2, "n", ("m",), None, (), ()),
        ("P2", "numpy.mean", m2 + 8, "a", ("d",), None, (), ()),
        ("P2C", "numpy.mean", m2 + 8, "a", ("d",), "numpy.median", (), (s1,)),
        # plt.plot: a different module, and no branching inside ".plot": no event
        ("P2C", "numpy.mean", m4 + 5, "a", ("d",), "numpy.median", (s2,), (s1,)),
    ]
    assert [e.char_index for e in ev] == [8, 0, 8, 8, 8]
    assert all(trace[e.anchor] == e.target for e in ev)
    assert t.related("numpy.mean", "numpy.median") and not t.related("numpy.mean", "matplotlib.pyplot.plot")
    assert (trace.index("plt.plot"), trace.index("plt.plot") + 8) in t.item_like_spans(trace, list(p.items))


def test_parser_and_metric(tmp_path):
    p = load_bigcodebench(_write(tmp_path / "bcb.jsonl", [_problem("BigCodeBench/7")]))[0]
    t = p.task()
    gen = ("<think>x</think>\n```python\nprint(1)\n```\nthen\n```python\nimport numpy as np\n"
           "def task_func(data):\n    return np.mean(data)\n```")
    code = t.parse_answer(gen)
    assert code == ("import numpy as np\ndef task_func(data):\n    return np.mean(data)\n",)
    assert t.parse_answer("<think>x</think>\nno code") == () and t.parse_answer("<think>```python\nx\n```") == ()
    m = t.metric((p.reference_code,), code)
    assert m == {"parses": 1.0, "api_f1": pytest.approx(0.5)}  # 1 of the reference's 3 namings
    assert t.metric((p.reference_code,), ("def f(:\n",)) == {"parses": 0.0, "api_f1": 0.0}
    assert task("bigcodebench").parse_answer(gen) == code  # the unbound task parses the same way
