"""BigCodeBench (Zhuo et al., 2025): library-based code generation (paper App. P).

Events are the qualified API-attribute namings in the reasoning (``numpy.mean``, or ``np.mean``
under the problem's ``import numpy as np``): P2 at the characters of a first naming where the
problem's API inventory branches (no P1), P2C where an attribute is named after another
attribute of the same module, at their first differing character.

Input: the release's JSONL (``task_id``, ``complete_prompt``, ``instruct_prompt``,
``canonical_solution``, ``code_prompt``, ``test``, ``entry_point``, ``libs``), read from a
local path by :func:`load_bigcodebench` (never downloaded). ``libs`` is a list of module names,
or the release's string spelling of one (``"['numpy', 'pandas']"``).

Choices the paper does not fix **[recon]**:

* **Aliases** come from the import statements of ``code_prompt`` (read line by line, no
  execution): ``import numpy as np`` binds ``np`` to ``numpy``; ``import os.path`` binds ``os``;
  ``from matplotlib import pyplot as plt`` binds ``plt`` to ``matplotlib.pyplot`` and
  ``from collections import Counter`` binds ``Counter`` to ``collections.Counter`` (whether
  the imported name is a module or a class is not looked up). A full top-level module name
  (of ``libs`` or of an import) always names itself, imported under an alias or not.
* **Naming**: a dotted chain of identifiers not preceded by a dot or an identifier character
  (``np.linalg.norm``), its first name resolved through the aliases; the naming is the longest
  chain prefix (at least one attribute) whose resolution is in the inventory. Its *item* is
  the resolved ``module.attr`` path; its *module* is everything before the last dot.
* **Inventory** of a problem: the resolved namings that ``complete_prompt``,
  ``instruct_prompt``, ``code_prompt`` and ``canonical_solution`` write, whose top-level module
  is one of ``libs`` or imported by ``code_prompt``. The libraries are not imported to list
  everything they expose.
* **Written forms**: a naming written through an alias (``np.mean``) gets events only where its
  characters are the item's (the attribute part, ``.mean``), by the extractor's rule.
* **Tokens**: attribute names are identifiers a tokenizer keeps whole (``median``), so an event's
  competitors are the alternative namings' own first tokens from the divergence on
  (:attr:`BigCodeBenchTask.word_items`), as the paper's "trie-divergent tokens".
* **Item-like spans** for NULL placement: every chain whose first name is an alias or a known
  top-level module, named or not.
* **Answer**: the last fenced code block (```` ```python ````, ```` ```py ```` or a bare fence)
  after ``</think>``; no block, or an unclosed reasoning block, gives no answer.
* **Metric**: ``parses`` (1.0 when ``ast.parse`` accepts the code) and ``api_f1``, the set F1
  of the resolved API namings of the code against those of the reference solution
  (``code_prompt + canonical_solution``), the code's own imports joining the problem's aliases.

pass@1, the paper's native metric, executes each answer's code with the problem's tests in
the sandbox of :mod:`mistill.evaluation.sandbox` (:func:`execute`): the program is the answer's
code block followed by the ``test`` field, as BigCodeBench runs it; an answer without a code
block is a ``no_code`` verdict and counts as not passed.

The stages read the release through :func:`load_bigcodebench_corpus` (``prepare -P
task=bigcodebench``), with these further choices **[recon]**:

* **Prompt**: no candidate list (:data:`BIGCODEBENCH_WORDING`); the note is the problem's
  ``instruct_prompt`` (BigCodeBench-Instruct: the task in words, then the code to start from,
  whose imports name the libraries). Its id is the ``task_id`` with ``/`` written ``-``.
* **Candidates**: each problem's :attr:`BigCodeBenchProblem.items` are its note's own
  (``shortlist``); a note's task is bound to the imports of its text (:meth:`BigCodeBenchTask.
  for_note`). The inventory is the union of the problems' items.
* **Gold and answer as sets**: the gold is the set of API namings of the reference program; a
  generation's answer is the set of API namings of its last code block (its own imports resolving
  aliases), so set counts give the API F1 and micro-F1 pools it. A problem whose reference names
  no API of its libraries is left out (the corpus records how many).
* **Batches**: ``split_sizes`` (ranking, assessment and fresh counts) deals the problems in file
  order to ``train``, ``val`` and ``test``; without it every problem is a ``test`` note.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import json
import random

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import PromptWording
from mistill.errors import MistillInputError
from mistill.evaluation.parsing import Answer, degenerate_reason
from mistill.evaluation.sandbox import SandboxLimits, Verdict, run_programs
from mistill.tasks.base import (AnswerReader, Mention, Record, Span, Task, _merge, answer_part, jsonl_records,
                                read_traces, set_scores)

__all__ = ["BigCodeBenchTask", "BigCodeBenchProblem", "load_bigcodebench", "import_aliases", "api_namings",
           "last_code_block", "program", "execute", "BIGCODEBENCH_WORDING", "note_id_of",
           "load_bigcodebench_corpus", "write_bigcodebench_fixture", "note_program", "pytest_program",
           "PYTEST_STYLE"]

_CHAIN = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_IMPORT = re.compile(r"^\s*import\s+(.+?)\s*(?:#.*)?$", re.MULTILINE)
_FROM = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+\(?(.+?)\)?\s*(?:#.*)?$", re.MULTILINE)
_AS = re.compile(r"^([\w.]+)(?:\s+as\s+(\w+))?$")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def import_aliases(code: str) -> dict[str, str]:
    """Name -> what it stands for, from the import statements of ``code`` (see the module
    docstring). Relative imports and ``import *`` bind nothing."""
    out: dict[str, str] = {}
    for m in _IMPORT.finditer(code):
        for part in m.group(1).split(","):
            a = _AS.match(part.strip())
            if a is None:
                continue
            target, alias = a.group(1), a.group(2)
            if alias:
                out[alias] = target
            else:
                root = target.split(".")[0]
                out[root] = root
    for m in _FROM.finditer(code):
        module = m.group(1)
        if module.startswith("."):
            continue
        for part in m.group(2).split(","):
            a = _AS.match(part.strip())
            if a is None or "." in a.group(1):
                continue
            out[a.group(2) or a.group(1)] = f"{module}.{a.group(1)}"
    return out


def _resolve(chain: str, aliases: Mapping[str, str], roots: Collection[str]) -> list[tuple[str, int]]:
    """``(resolved, written length)`` of every prefix of ``chain`` with at least one attribute,
    longest first, when its first name is an alias or a root module; else []."""
    names = chain.split(".")
    head = aliases.get(names[0]) or (names[0] if names[0] in roots else None)
    if head is None:
        return []
    out = []
    for k in range(len(names), 1, -1):
        out.append((".".join([head, *names[1:k]]), len(".".join(names[:k]))))
    return out


def api_namings(code: str, aliases: Mapping[str, str], roots: Collection[str]) -> set[str]:
    """The resolved namings (whole chains) of ``code`` whose top-level module is in ``roots``."""
    out = set()
    for m in _CHAIN.finditer(code):
        res = _resolve(m.group(), aliases, roots)
        if res and res[0][0].split(".")[0] in roots:
            out.add(res[0][0])
    return out


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block of ``text``, or None."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


def _parse_libs(rec: Record) -> tuple[str, ...]:
    value = rec.row.get("libs")
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value) if value.strip() else []
        except (ValueError, SyntaxError):
            raise rec.fail(f"not a list of module names: {value[:60]!r}", "libs") from None
    if not isinstance(value, (list, tuple)):
        raise rec.fail("missing field" if value is None else "must be a list of module names", "libs")
    if not all(isinstance(v, str) and v.strip() for v in value):
        raise rec.fail("entries must be module names", "libs")
    return tuple(v.strip() for v in value)


@dataclass(frozen=True)
class BigCodeBenchProblem:
    """One BigCodeBench problem as the release gives it."""

    task_id: str
    complete_prompt: str
    instruct_prompt: str
    canonical_solution: str
    code_prompt: str
    test: str
    entry_point: str
    libs: tuple[str, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def roots(self) -> frozenset[str]:
        """Top-level modules the problem may name: ``libs`` and the modules it imports."""
        return frozenset(self.libs) | {v.split(".")[0] for v in self.aliases.values()}

    @property
    def reference_code(self) -> str:
        """The canonical solution as a program: ``code_prompt + canonical_solution``."""
        return self.code_prompt + self.canonical_solution

    @property
    def items(self) -> dict[str, str]:
        """The problem's API inventory: resolved naming -> ``"<attr> of <module>"``."""
        found: set[str] = set()
        for text in (self.complete_prompt, self.instruct_prompt, self.code_prompt, self.canonical_solution):
            found |= api_namings(text, self.aliases, self.roots)
        return {n: f"{n.rsplit('.', 1)[1]} of {n.rsplit('.', 1)[0]}" for n in sorted(found)}

    def task(self) -> BigCodeBenchTask:
        """The task bound to this problem (its aliases, roots and inventory)."""
        return BigCodeBenchTask(aliases=self.aliases, roots=self.roots, items=self.items)


def load_bigcodebench(path: str | Path) -> list[BigCodeBenchProblem]:
    """Read a BigCodeBench JSONL file; a malformed record raises :class:`MistillInputError`
    naming the file, the line, the ``task_id`` and the field."""
    out = []
    for rec, tid in jsonl_records(path, "task_id"):
        code_prompt = rec.text("code_prompt", allow_empty=False)
        out.append(BigCodeBenchProblem(
            task_id=tid, complete_prompt=rec.text("complete_prompt", allow_empty=False),
            instruct_prompt=rec.text("instruct_prompt", allow_empty=False),
            canonical_solution=rec.text("canonical_solution", allow_empty=False), code_prompt=code_prompt,
            test=rec.text("test"), entry_point=rec.text("entry_point", allow_empty=False),
            libs=_parse_libs(rec), aliases=import_aliases(code_prompt)))
    if not out:
        raise MistillInputError("no problems in the file", file=str(path))
    return out


class BigCodeBenchTask(Task):
    """Qualified API namings. Unbound (the registry's instance) it knows no aliases and no
    inventory; :meth:`BigCodeBenchProblem.task` binds one problem's."""

    name = "bigcodebench"
    has_p1 = False
    word_items = True  # attribute names are identifiers a tokenizer keeps whole: the alternatives' tokens compete

    def __init__(self, aliases: Mapping[str, str] | None = None, roots: Iterable[str] = (),
                 items: Mapping[str, str] | None = None) -> None:
        super().__init__(items)
        self.aliases = dict(aliases or {})
        self.roots = frozenset(roots) | {v.split(".")[0] for v in self.aliases.values()} | \
            {n.split(".")[0] for n in self.items}

    def find_mentions(self, text: str, items: Collection[str], start: int = 0,
                      end: int | None = None) -> list[Mention]:
        item_set = set(items)
        roots = self.roots | {n.split(".")[0] for n in item_set}
        end = len(text) if end is None else end
        out = []
        for m in _CHAIN.finditer(text, start, end):
            for resolved, n in _resolve(m.group(), self.aliases, roots):
                if resolved in item_set:
                    out.append((resolved, m.start(), m.start() + n))
                    break
        return out

    def for_note(self, note: object) -> "BigCodeBenchTask":
        """Bound to one prepared problem: the imports of its prompt (the note's text) as aliases,
        its candidates (``shortlist``) as the inventory."""
        items = getattr(note, "shortlist", None) or ()
        return BigCodeBenchTask(aliases=import_aliases(getattr(note, "text", "")), roots=self.roots,
                                items={i: self.items.get(i, "") for i in items})

    def answer_reader(self, codes: Collection[str]) -> AnswerReader:
        """A generation's answer as the set of API namings of its last code block (the block's own
        imports resolve its aliases; namings outside ``codes`` are counted, not kept); a
        generation without a code block is valid but not parsed (reason ``no_code``)."""
        known = frozenset(codes)
        roots = self.roots | {c.split(".")[0] for c in known}

        def read(generation: str, capped: bool = False) -> Answer:
            def answer(found: tuple[str, ...], valid: bool, parsed: bool, reason: str, n_raw: int = 0,
                       n_out: int = 0) -> Answer:
                flag = degenerate_reason(found, capped)
                return Answer(found, valid, parsed, reason, n_raw, n_out, 0, bool(flag), flag)

            if capped:
                return answer((), False, False, "capped")
            part = answer_part(generation)
            if part is None:
                return answer((), False, False, "unclosed_think")
            code = last_code_block(part)
            if code is None:
                return answer((), True, False, "no_code")
            named = api_namings(code, {**self.aliases, **import_aliases(code)}, roots)
            kept = tuple(sorted(n for n in named if n in known))
            return answer(kept, True, True, "ok", len(named), len(named) - len(kept))
        return read

    def execute_answers(self, notes: Sequence[object], generations: Sequence[str]) -> list[str]:
        """Each generation's code block and its prepared problem's tests run in the sandbox
        (:func:`note_program`), one after another: the verdicts' outcomes, in order."""
        programs = [(getattr(n, "note_id", ""), note_program(n, g)) for n, g in zip(notes, generations, strict=True)]
        return [v.outcome for v in run_programs(programs)]

    def related(self, a: str, b: str) -> bool:
        """Same module, different attribute."""
        return a != b and "." in a and "." in b and a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]

    def item_like_spans(self, trace: str, items: Collection[str]) -> list[Span]:
        roots = self.roots | {n.split(".")[0] for n in items}
        spans = [(m.start(), m.end()) for m in _CHAIN.finditer(trace) if _resolve(m.group(), self.aliases, roots)]
        return _merge(spans + [(s, e) for _, s, e in self.find_mentions(trace, items)])

    def parse_answer(self, generation: str) -> tuple[str, ...]:
        """``(code,)``: the last fenced code block after ``</think>``; ``()`` when none."""
        part = answer_part(generation)
        code = last_code_block(part) if part is not None else None
        return () if code is None else (code,)

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        """``parses`` and ``api_f1`` of the predicted code (``pred[0]``) against the reference
        program ``gold[0]``; executing the tests is out of scope (module docstring)."""
        if not gold:
            raise MistillInputError("the metric needs the reference program as gold[0]", field="gold")
        code = pred[0] if pred else ""
        try:
            ast.parse(code)
            parses = 1.0 if code.strip() else 0.0
        except SyntaxError:
            parses = 0.0
        ref_aliases = {**self.aliases, **import_aliases(gold[0])}
        pred_aliases = {**self.aliases, **import_aliases(code)}
        roots = self.roots | {v.split(".")[0] for v in ref_aliases.values()}
        ref = api_namings(gold[0], ref_aliases, roots)
        got = api_namings(code, pred_aliases, roots) if code else set()
        return {"parses": parses, "api_f1": set_scores(ref, got)["f1"]}


def program(problem: BigCodeBenchProblem, generation: str) -> str | None:
    """The program run for one answer: its code block (:meth:`BigCodeBenchTask.parse_answer`), then
    the problem's tests; None when the generation holds no code."""
    code = BigCodeBenchTask().parse_answer(generation)
    return f"{code[0]}\n\n{problem.test}\n" if code and code[0].strip() else None


def execute(problems: Sequence[BigCodeBenchProblem], generations: Mapping[str, str], *,
            limits: SandboxLimits = SandboxLimits()) -> list[Verdict]:
    """One sandboxed verdict per problem, in order, for the generation ``generations[task_id]``
    (a problem without a generation is a ``no_code`` verdict); pass@1 is
    :func:`mistill.evaluation.sandbox.pass_at_1` of the result."""
    return run_programs(((p.task_id, program(p, generations[p.task_id]) if p.task_id in generations else None)
                         for p in problems), limits=limits)


# ------------------------------------------------------------------------- through the stages

BIGCODEBENCH_WORDING = PromptWording(
    header="", shows_list=False,
    summary_header="Here is the programming task:",
    role_and_task=("You are an experienced Python programmer. Solve the task above with the libraries its code "
                   "imports."),
    narrow_sentence=("Narrow down first to the modules of those libraries that fit the task, then decide on the "
                     "specific functions and attributes within them."),
    answer="Give your final answer as one fenced python code block holding the whole program.")
"""The prompt's sentences for a problem (**[recon]**: the paper gives the task, not its prompt)."""

_BATCHES: tuple[str, ...] = ("train", "val", "test")


def note_id_of(task_id: str) -> str:
    """A problem's note id: its ``task_id`` with ``/`` written ``-`` (``BigCodeBench/13`` ->
    ``BigCodeBench-13``; a note id names a folder)."""
    return task_id.replace("/", "-")


PYTEST_STYLE = "pytest"
"""``Note.meta["test_style"]`` of a problem whose tests are pytest functions importing the answer
as the module ``solution`` (KodCode's, :mod:`mistill.tasks.kodcode`), run through
:func:`pytest_program`; without it the tests are BigCodeBench's ``unittest`` classes."""


def note_program(note: Note, generation: str) -> str | None:
    """The program the sandbox runs for a generation on a prepared problem: its last code block,
    then the problem's tests (kept in the note's ``meta``; pytest-style tests through
    :func:`pytest_program`); None without a code block."""
    part = answer_part(generation)
    code = last_code_block(part) if part is not None else None
    if code is None or not code.strip():
        return None
    if note.meta.get("test_style") == PYTEST_STYLE:
        return pytest_program(code, str(note.meta.get("test", "")))
    return f"{code}\n\n{note.meta.get('test', '')}\n"


def pytest_program(code: str, test: str) -> str:
    """One program for the sandbox from an answer's ``code`` and a problem's pytest ``test``
    (module docstring): the code becomes the module ``solution``, then the tests, then a
    ``unittest.TestCase`` calling each top-level ``test_*`` function."""
    return (f"import sys as _sys, types as _types\n"
            f"_solution = _types.ModuleType('solution')\n"
            f"exec(compile({code!r}, 'solution.py', 'exec'), _solution.__dict__)\n"
            f"_sys.modules['solution'] = _solution\n\n"
            f"{test}\n\n"
            f"import unittest as _unittest\n\n\n"
            f"class KodCodeTests(_unittest.TestCase):\n    pass\n\n\n"
            f"def _collect(names):\n"
            f"    for name, fn in names:\n"
            f"        if name.startswith('test') and callable(fn) and not isinstance(fn, type):\n"
            f"            setattr(KodCodeTests, name if name.startswith('test_') else 'test_' + name,\n"
            f"                    (lambda f: lambda self: f())(fn))\n\n\n"
            f"_collect(list(globals().items()))\n")


def load_bigcodebench_corpus(path: str | Path, *, traces_file: str | Path = "", split_sizes: Sequence[int] = (),
                             order_seed: int = 0, name: str = "bigcodebench", privacy: str = "public") -> Corpus:
    """BigCodeBench problems as a corpus (module docstring): one note per problem whose reference
    names an API of its libraries (:func:`note_id_of`; its ``instruct_prompt`` as text; the
    reference's API namings as gold; its items as ``shortlist``; its tests, entry point and
    libraries in ``meta``), its trace from ``traces_file`` (JSONL rows ``{"task_id", "trace"}``)
    when given. ``split_sizes`` (ranking, assessment, fresh) deals the problems in file order to
    ``train``, ``val`` and ``test`` and leaves the rest out; empty makes every problem a ``test``
    note. A trace for an unknown problem or a malformed record raises, naming the file, the
    problem and the field."""
    if split_sizes and (len(split_sizes) != 3 or min(split_sizes) < 0 or not sum(split_sizes)):
        raise MistillInputError(f"split_sizes must be three counts (ranking, assessment, fresh), not "
                                f"{tuple(split_sizes)!r}", field="split_sizes")
    problems = load_bigcodebench(path)
    traces = read_traces(traces_file, "task_id", {p.task_id for p in problems}, "a problem") if traces_file else {}
    bounds = [sum(split_sizes[:i + 1]) for i in range(len(split_sizes))]
    notes, items, left_out = [], {}, 0
    for problem in problems:
        gold = tuple(sorted(api_namings(problem.reference_code, problem.aliases, problem.roots)))
        if not gold:
            left_out += 1
            continue
        k = len(notes)
        if split_sizes and k >= bounds[-1]:
            break
        split = _BATCHES[next(i for i, b in enumerate(bounds) if k < b)] if split_sizes else "test"
        own = problem.items
        items.update(own)
        notes.append(Note(note_id=note_id_of(problem.task_id), patient_id=note_id_of(problem.task_id), split=split,
                          text=problem.instruct_prompt, gold_codes=gold, teacher_trace=traces.get(problem.task_id),
                          shortlist=tuple(own),
                          meta={"source": "BigCodeBench", "task_id": problem.task_id, "test": problem.test,
                                "entry_point": problem.entry_point, "libs": list(problem.libs)}))
    if not notes:
        raise MistillInputError("no problem whose reference names an API of its libraries", file=str(path),
                                field="corpus")
    codes = sorted(items)
    random.Random(order_seed).shuffle(codes)
    inventory = Inventory(codes=tuple(codes), descriptions=items, order_seed=order_seed, task="bigcodebench",
                          source="BigCodeBench API namings (prompts and reference solutions)")
    return Corpus(name=name, privacy=privacy, notes=notes, inventory=inventory,
                  meta={"task": "bigcodebench", "left_out_without_api": left_out})


_FIXTURE_TASKS: tuple[tuple[str, str, str, str], ...] = (
    ("the square root of the sum of squares of a list", "math", "math.sqrt(sum(x * x for x in values))",
     "self.assertAlmostEqual(task_func([3, 4]), 5.0)"),
    ("the median of a list", "statistics", "statistics.median(values)",
     "self.assertEqual(task_func([1, 5, 2]), 2)"),
    ("the most common element of a list", "collections", "collections.Counter(values).most_common(1)[0][0]",
     "self.assertEqual(task_func(['a', 'b', 'a']), 'a')"),
    ("the product of a list", "math", "math.prod(values)", "self.assertEqual(task_func([2, 3, 4]), 24)"),
    ("the population standard deviation of a list", "statistics", "statistics.pstdev(values)",
     "self.assertAlmostEqual(task_func([1, 1, 1]), 0.0)"),
    ("the mean of a list", "statistics", "statistics.mean(values)", "self.assertEqual(task_func([1, 2, 3]), 2)"),
)
_NEAR: Mapping[str, str] = {"math": "math.fsum", "statistics": "statistics.mode", "collections": "collections.deque"}


def write_bigcodebench_fixture(folder: str | Path, *, n_problems: int = 8,
                               kinds: Sequence[int] = ()) -> dict[str, Path]:
    """A small release of the project's own in BigCodeBench's layout under ``folder``: invented
    problems on the standard library (their tests run in the sandbox without third-party
    packages) in ``bigcodebench.jsonl``, and a scripted teacher trace per problem in
    ``traces.jsonl`` (the module, a near-miss attribute of it, the chosen one, and a code block
    that passes). ``kinds``: which of the six invented problems each problem is, in order (then
    ``n_problems`` is its length); empty cycles through them. Problems of one kind share their
    events' tokens, so each can stand in the other's context (a knock-in's donor). Returns the
    paths by role (``corpus``, ``traces_file``)."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rows, traces = [], []
    order = list(kinds) or [i % len(_FIXTURE_TASKS) for i in range(n_problems)]
    for i, kind in enumerate(order):
        what, module, body, check = _FIXTURE_TASKS[kind]
        code_prompt = f"import {module}\n\ndef task_func(values):\n"
        solution = f"    return {body}\n"
        test = (f"import unittest\n\nclass TestCases(unittest.TestCase):\n    def test_case(self):\n"
                f"        {check}\n")
        task_id = f"BigCodeBench/{i}"
        rows.append({"task_id": task_id, "libs": [module], "entry_point": "task_func", "test": test,
                     "code_prompt": code_prompt, "canonical_solution": solution,
                     "complete_prompt": f"{code_prompt}    \"\"\"Return {what} (compare {_NEAR[module]}).\"\"\"\n",
                     "instruct_prompt": (f"Write a function that returns {what}.\nYou should write self-contained "
                                         f"code starting with:\n```\n{code_prompt}```")})
        api = re.findall(rf"{module}\.\w+", body)[0]
        trace = (f"<think>The task asks for {what}. The standard module {module} has what is needed. "
                 f"I could reach for {_NEAR[module]} here, but the task wants {api}, so the function returns "
                 f"{api} over the values.</think>\n```python\n{code_prompt}{solution}```")
        traces.append({"task_id": task_id, "trace": trace})
    paths = {"corpus": root / "bigcodebench.jsonl", "traces_file": root / "traces.jsonl"}
    paths["corpus"].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    paths["traces_file"].write_text("".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8")
    return paths
