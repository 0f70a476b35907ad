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
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mistill.errors import MistillInputError
from mistill.evaluation.sandbox import SandboxLimits, Verdict, run_programs
from mistill.tasks.base import Mention, Record, Span, Task, _merge, answer_part, jsonl_records, set_scores

__all__ = ["BigCodeBenchTask", "BigCodeBenchProblem", "load_bigcodebench", "import_aliases", "api_namings",
           "last_code_block", "program", "execute"]

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
