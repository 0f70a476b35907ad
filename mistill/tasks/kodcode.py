"""KodCode (Xu et al., 2025): the training problems of App. P's programming pilot.

The pilot distils on KodCode problems and reads its students on BigCodeBench, so a KodCode
problem is prepared in BigCodeBench's label space (the qualified API namings of
:mod:`mistill.tasks.bigcodebench`; the prepared inventory's task is ``bigcodebench``) and its
events are extracted by the same rules.

Input: KodCode-V1's rows as JSONL (``question_id``, ``question``, ``solution``, ``test``,
``test_info``: a list of ``{function_name, function_declaration, ...}``; other fields are kept
out), read from a local path by :func:`load_kodcode` (never downloaded). A malformed record raises
:class:`~mistill.errors.MistillInputError` naming the file, the line, the ``question_id`` and the
field.

Choices the paper does not fix **[recon]**:

* **Libraries** of a problem are the top-level modules its reference ``solution`` imports; its
  aliases are that solution's import statements (:func:`~mistill.tasks.bigcodebench.import_aliases`).
* **Eligibility**: a problem whose solution names no API of those libraries is left out, as on
  BigCodeBench (the corpus records how many); a kept problem whose teacher trace names none gets no
  event and trains on the CoT loss only (App. P: "the problems without a first-mention event").
* **Prompt**: the note is the question followed, in BigCodeBench-Instruct's form, by the code to
  start from: the solution's import lines and the declared functions (``test_info``), so the prompt
  names the libraries as a BigCodeBench prompt does and binds the aliases a trace may use
  (:meth:`~mistill.tasks.bigcodebench.BigCodeBenchTask.for_note`).
* **Candidates and gold**: a problem's candidates (``shortlist``) are the API namings of its
  question, starting code and solution; its gold, those of the solution.
* **Split**: ``split_sizes`` holds one count, the training problems: the first that many eligible
  problems in an ``order_seed`` shuffle of the file's eligible problems (App. P: "a locked split of
  2,000", whose draw the paper does not publish), all ``train`` notes; a ``split_file`` of
  ``question_id`` s takes a locked split as given instead; neither keeps every eligible problem.
* **Tests**: KodCode's pytest-style test functions (``from solution import f``) run in the
  sandbox of :mod:`mistill.evaluation.sandbox` through
  :func:`~mistill.tasks.bigcodebench.pytest_program`: the answer's code is
  registered as the module ``solution``, and each top-level ``test_*`` function becomes a test
  case. A test function taking arguments (a pytest fixture) fails; a test needing ``pytest`` needs it
  installed in the interpreter the sandbox runs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import Inventory
from mistill.errors import MistillInputError
from mistill.tasks.base import Record, jsonl_records, read_traces
from mistill.tasks.bigcodebench import PYTEST_STYLE, api_namings, import_aliases

__all__ = ["KodCodeProblem", "load_kodcode", "load_kodcode_corpus", "write_kodcode_fixture", "note_id_of",
           "read_split_file"]

@dataclass(frozen=True)
class KodCodeProblem:
    """One KodCode problem as the release gives it."""

    question_id: str
    question: str
    solution: str
    test: str
    declarations: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def roots(self) -> frozenset[str]:
        """The top-level modules the solution imports."""
        return frozenset(v.split(".")[0] for v in self.aliases.values())

    @property
    def import_lines(self) -> tuple[str, ...]:
        """The solution's top-level import statements, in order."""
        return tuple(line.rstrip() for line in self.solution.splitlines()
                     if line.startswith("import ") or (line.startswith("from ") and " import " in line))

    @property
    def starting_code(self) -> str:
        """The code the prompt starts from: the import lines, then each declared function."""
        parts = list(self.import_lines)
        if parts and self.declarations:
            parts.append("")
        parts += [d if d.rstrip().endswith(":") else d.rstrip() + ":" for d in self.declarations]
        return "\n".join(parts) + ("\n" if parts else "")

    @property
    def prompt(self) -> str:
        """The note's text (module docstring)."""
        start = self.starting_code
        if not start:
            return self.question
        return f"{self.question.rstrip()}\nYou should write self-contained code starting with:\n```\n{start}```"

    @property
    def items(self) -> dict[str, str]:
        """The problem's API inventory: resolved naming -> ``"<attr> of <module>"``."""
        found: set[str] = set()
        for text in (self.question, self.starting_code, self.solution):
            found |= api_namings(text, self.aliases, self.roots)
        return {n: f"{n.rsplit('.', 1)[1]} of {n.rsplit('.', 1)[0]}" for n in sorted(found)}

    @property
    def gold(self) -> tuple[str, ...]:
        """The API namings of the reference solution."""
        return tuple(sorted(api_namings(self.solution, self.aliases, self.roots)))


def _declarations(rec: Record) -> tuple[str, ...]:
    value = rec.row.get("test_info")
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise rec.fail("must be a list of function records", "test_info")
    out = []
    for i, entry in enumerate(value):
        sub = Record(entry, file=rec.file, line=rec.line, record=rec.record, prefix=f"test_info[{i}].")
        decl = sub.text("function_declaration", default="").strip()
        if decl:
            out.append(decl)
    return tuple(out)


def load_kodcode(path: str | Path) -> list[KodCodeProblem]:
    """Read KodCode rows (JSONL); a malformed record raises :class:`MistillInputError` naming the
    file, the line, the ``question_id`` and the field."""
    out = []
    for rec, qid in jsonl_records(path, "question_id"):
        solution = rec.text("solution", allow_empty=False)
        out.append(KodCodeProblem(question_id=qid, question=rec.text("question", allow_empty=False),
                                  solution=solution, test=rec.text("test", allow_empty=False),
                                  declarations=_declarations(rec), aliases=import_aliases(solution)))
    if not out:
        raise MistillInputError("no problems in the file", file=str(path))
    return out


def note_id_of(question_id: str) -> str:
    """A problem's note id: its ``question_id`` with ``/`` written ``-`` (a note id names a folder)."""
    return question_id.replace("/", "-")


def read_split_file(path: str | Path) -> list[str]:
    """The ``question_id`` s of a locked split, one per line (blank lines skipped); a repeated id
    raises, naming the file and the line."""
    ids: list[str] = []
    seen: set[str] = set()
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        qid = line.strip()
        if not qid:
            continue
        if qid in seen:
            raise MistillInputError("a question_id listed twice", file=str(path), line=lineno, note=qid,
                                    field="question_id")
        seen.add(qid)
        ids.append(qid)
    if not ids:
        raise MistillInputError("no question_id in the split file", file=str(path), field="split_file")
    return ids


def load_kodcode_corpus(path: str | Path, *, traces_file: str | Path = "", split_sizes: Sequence[int] = (),
                        split_file: str | Path = "", order_seed: int = 0, name: str = "kodcode",
                        privacy: str = "public") -> Corpus:
    """KodCode problems as a corpus of ``train`` notes in BigCodeBench's label space (module
    docstring): one note per eligible problem (its :attr:`KodCodeProblem.prompt` as text, its
    solution's API namings as gold, its items as ``shortlist``, its tests in ``meta`` with
    ``test_style`` :data:`~mistill.tasks.bigcodebench.PYTEST_STYLE`), its trace from ``traces_file`` (JSONL rows
    ``{"question_id", "trace"}``) when given. ``split_sizes``: one count, the training problems
    drawn by ``order_seed``; ``split_file``: instead, the problems it lists (:func:`read_split_file`;
    an id the release lacks, or one not eligible, raises); neither keeps every eligible problem, in
    file order."""
    if split_sizes and (len(split_sizes) != 1 or split_sizes[0] < 1):
        raise MistillInputError(f"split_sizes must be one count (the training problems), not {tuple(split_sizes)!r}",
                                field="split_sizes")
    problems = load_kodcode(path)
    traces = read_traces(traces_file, "question_id", {p.question_id for p in problems}, "a problem") \
        if traces_file else {}
    eligible = [p for p in problems if p.gold]
    left_out = len(problems) - len(eligible)
    if not eligible:
        raise MistillInputError("no problem whose solution names an API of the modules it imports", file=str(path),
                                field="corpus")
    if split_file:
        listed = read_split_file(split_file)
        by_id = {p.question_id: p for p in eligible}
        known = {p.question_id for p in problems}
        for qid in listed:
            if qid not in by_id:
                why = "a listed problem the release does not hold" if qid not in known else \
                    "a listed problem whose solution names no API of the modules it imports"
                raise MistillInputError(why, file=str(split_file), note=qid, field="question_id")
        chosen_ids = set(listed)
        eligible = [p for p in eligible if p.question_id in chosen_ids]  # in file order
    elif split_sizes:
        order = list(range(len(eligible)))
        random.Random(order_seed).shuffle(order)
        chosen = sorted(order[:split_sizes[0]])  # the drawn problems, kept in file order
        eligible = [eligible[i] for i in chosen]
    notes, items = [], {}
    for problem in eligible:
        own = problem.items
        items.update(own)
        nid = note_id_of(problem.question_id)
        notes.append(Note(note_id=nid, patient_id=nid, split="train", text=problem.prompt, gold_codes=problem.gold,
                          teacher_trace=traces.get(problem.question_id), shortlist=tuple(own),
                          meta={"source": "KodCode", "question_id": problem.question_id, "test": problem.test,
                                "test_style": PYTEST_STYLE}))
    codes = sorted(items)
    random.Random(order_seed).shuffle(codes)
    inventory = Inventory(codes=tuple(codes), descriptions=items, order_seed=order_seed, task="bigcodebench",
                          source="KodCode API namings (questions and reference solutions)")
    return Corpus(name=name, privacy=privacy, notes=notes, inventory=inventory,
                  meta={"task": "kodcode", "label_space": "bigcodebench", "left_out_without_api": left_out,
                        "problems": len(problems)})


_FIXTURE: tuple[tuple[str, str, str, str, str], ...] = (
    ("Return the number of ways to choose k items from n.", "import math", "math.comb(n, k)", "n, k",
     "assert count_ways(5, 2) == 10"),
    ("Return the median of a list of numbers.", "import statistics", "statistics.median(values)", "values",
     "assert count_ways([3, 1, 2]) == 2"),
    ("Return the most frequent element of a list.", "import collections",
     "collections.Counter(values).most_common(1)[0][0]", "values", "assert count_ways(['a', 'b', 'a']) == 'a'"),
    ("Return the greatest common divisor of two integers.", "import math", "math.gcd(a, b)", "a, b",
     "assert count_ways(12, 18) == 6"),
    ("Return the mean of a list of numbers.", "import statistics", "statistics.mean(values)", "values",
     "assert count_ways([1, 2, 3]) == 2"),
    ("Return the sum of the first n squares.", "", "sum(i * i for i in range(n + 1))", "n",
     "assert count_ways(3) == 14"),
)
_NEAR: Mapping[str, str] = {"math": "math.perm", "statistics": "statistics.mode", "collections": "collections.deque"}


def write_kodcode_fixture(folder: str | Path, *, n_problems: int = 8) -> dict[str, Path]:
    """A small release of the project's own in KodCode-V1's layout under ``folder``: invented
    problems on the standard library in ``kodcode.jsonl`` (each question naming a near-miss
    attribute of its module; one problem without an import, left out as ineligible), and a scripted
    teacher trace per problem in ``traces.jsonl`` (the module, the near-miss attribute, the chosen
    one, and a passing code block). Returns the paths by role (``corpus``, ``traces_file``)."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rows, traces = [], []
    for i in range(n_problems):
        question, imports, body, args, check = _FIXTURE[i % len(_FIXTURE)]
        qid = f"Prefill_{i}_I"
        decl = f"def count_ways({args}):"
        solution = (f"{imports}\n\n" if imports else "") + f"{decl}\n    return {body}\n"
        test = f"from solution import count_ways\n\ndef test_count_ways():\n    {check}\n"
        module = imports.split()[-1] if imports else ""
        if module:  # the question names a near-miss attribute, a candidate the trace considers first
            question = f"{question} (It is not {_NEAR[module]}.)"
        rows.append({"question_id": qid, "question": question, "solution": solution, "test": test,
                     "test_info": [{"function_name": "count_ways", "function_declaration": decl,
                                    "parameter_list": f"({args})", "docstring": None}],
                     "style": "instruct", "subset": "Prefill"})
        if module:
            api = body.split("(")[0]
            reasoning = (f"The module {module} has what is needed. I could reach for {_NEAR[module]} here, but "
                         f"{api} is the one, so the function returns {api} over the arguments.")
        else:
            reasoning = "A generator expression over the range does it without any library."
        traces.append({"question_id": qid, "trace": f"<think>{reasoning}</think>\n```python\n{solution}```"})
    paths = {"corpus": root / "kodcode.jsonl", "traces_file": root / "traces.jsonl"}
    paths["corpus"].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    paths["traces_file"].write_text("".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8")
    return paths
