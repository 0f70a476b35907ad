"""A second embedded synthetic task: parts-catalogue coding of maintenance orders.

The label space is a catalogue of part identifiers such as ``KIT-204`` or ``PMP-517``: a
three-letter *family* prefix, a dash and a three-digit number. Families have distinct first
letters, so the first character of an identifier decides the family, as the chapter letter
decides the region of an ICD-10-CM code. The generator mirrors the clinical one
(:mod:`mistill.data.synthetic`): seeded maintenance orders whose requests paraphrase the
descriptions of 3-8 gold parts, and scripted ``<think>...</think>`` traces that narrow to
families, enumerate candidate lines, name a same-family part and set it aside, endorse the
chosen part, recap, then close with the JSON list of the gold parts.

Choices (none of them is the paper's; the task exists to test the adapter boundary) **[recon]**:

* **P1 is on**: the family letter (first character) is the region-level decision; its
  competitors are the other families' letters. P2 scores the digits where the catalogue's
  character trie branches; the dash is never scored.
* **Relation**: same family (the prefix before the dash), a different part.
* **Mention**: the maximal run of letters and digits joined by single dashes must equal a
  catalogue identifier (case-sensitive), so ``KIT-2041`` or ``KIT-204-B`` is no naming of
  ``KIT-204``. Item-like spans for NULL placement are the namings plus any run shaped like an
  identifier (two to five capitals, a dash, one to six letters or digits).
* **Answer**: the last JSON list after ``</think>``, restricted to catalogue identifiers and
  de-duplicated (the clinical parser with the catalogue as inventory); metric: set counts,
  precision / recall / F1 and P@8.

The catalogue is an :class:`~mistill.data.inventory.Inventory` (prompt lines
``"<identifier> <description>"`` in one seeded order). Its ``category`` (first three
characters) is the family and its chapter letter the family letter, so the inventory-driven
parts of the pipeline (prompt lines, sibling lines, span buckets) read it unchanged; the corpus
is a :class:`~mistill.data.corpus.Corpus` with ``gold_codes`` holding part identifiers.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Collection, Mapping, Sequence

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import Inventory
from mistill.data.prompts import PromptWording
from mistill.data.synthetic import _split_counts
from mistill.errors import MistillInputError
from mistill.evaluation.metrics import precision_at_k
from mistill.evaluation.parsing import CodeIndex, parse_answer
from mistill.tasks.base import Mention, Span, Task, _merge, set_scores

__all__ = ["CatalogTask", "FAMILIES", "make_catalog_inventory", "make_catalog_corpus",
           "catalog_trace", "family"]

# family prefix -> (plural name, singular noun); first letters are distinct
FAMILIES: dict[str, tuple[str, str]] = {
    "ADP": ("adapters", "adapter"), "BRG": ("bearings", "bearing"),
    "CBL": ("cables", "cable"), "DRV": ("drives", "drive"), "FLT": ("filters", "filter"),
    "GSK": ("gaskets", "gasket"), "HOS": ("hoses", "hose"), "KIT": ("repair kits", "repair kit"),
    "LMP": ("lamps", "lamp"), "MTR": ("motors", "motor"), "NZL": ("nozzles", "nozzle"),
    "PMP": ("pumps", "pump"), "RLY": ("relays", "relay"), "SNS": ("sensors", "sensor"),
    "TRM": ("terminals", "terminal"), "VLV": ("valves", "valve"), "WHL": ("wheels", "wheel"),
}
_MATERIALS = ("brass", "stainless", "nylon", "cast iron", "aluminium", "rubber", "copper", "ceramic")
_SIZES = ("6 mm", "10 mm", "12 mm", "20 mm", "25 mm", "40 mm", "1/2 inch", "3/4 inch")
_USES = ("for coolant lines", "for the boiler loop", "for conveyor drives", "for outdoor use",
         "for high pressure", "for potable water", "for the paint line", "for food handling")

CATALOG_WORDING = PromptWording(
    header="Below is the catalogue of orderable parts, one per line: the part number, then its description.",
    summary_header="Here is the maintenance order to fill:",
    role_and_task=("You are an experienced parts planner. Assign catalogue part numbers to the maintenance "
                   "order above, choosing only from the complete catalogue given above it."),
    narrow_sentence=("Narrow down first to the plausible part families of the catalogue, then decide among "
                     "the specific parts within them."),
    answer=("Give your final answer as a JSON list of part-number strings, with every part number written "
            "exactly as it appears in the catalogue."))
"""The catalogue's prompt sentences, in the layout of the clinical prompt."""

_UNIT = re.compile(r"[^\W_]+(?:-[^\W_]+)*")
_ID_SHAPE = re.compile(r"[A-Z]{2,5}-[0-9A-Z]{1,6}")


def family(item: str) -> str:
    """The family prefix of a part identifier: ``"KIT-204"`` -> ``"KIT"``."""
    return item.split("-", 1)[0]


class CatalogTask(Task):
    """Part identifiers of a catalogue. ``inventory``: the catalogue (default: the seed-0
    catalogue of :func:`make_catalog_inventory`)."""

    name = "catalog"
    has_p1 = True
    unscored_chars = frozenset("-")

    def __init__(self, inventory: Inventory | None = None) -> None:
        super().__init__()
        self._inventory = inventory

    @functools.cached_property
    def inventory(self) -> Inventory:
        return self._inventory if self._inventory is not None else make_catalog_inventory(0)

    @property
    def items(self) -> Mapping[str, str]:
        return self.inventory.descriptions

    def normalise_items(self, items: Collection[str], *, note_id: str | None = None) -> tuple[str, ...]:
        out = super().normalise_items(items, note_id=note_id)
        for it in out:
            if _UNIT.fullmatch(it) is None:
                raise MistillInputError(f"catalogue item {it!r} is not letters and digits joined by "
                                        "dashes", note=note_id, field="codes")
        return out

    def find_mentions(self, text: str, items: Collection[str], start: int = 0,
                      end: int | None = None) -> list[Mention]:
        item_set = set(items)
        end = len(text) if end is None else end
        return [(m.group(), m.start(), m.end()) for m in _UNIT.finditer(text, start, end)
                if m.group() in item_set]

    def related(self, a: str, b: str) -> bool:
        """Same family, different part."""
        return a != b and family(a) == family(b)

    def p1_target(self, item: str) -> str | None:
        return item[0]

    def null_choices(self, items: Collection[str]) -> tuple[str, ...]:
        """The family letters of the catalogue (the P1 alphabet)."""
        return tuple(sorted({it[0] for it in items}))

    def item_like_spans(self, trace: str, items: Collection[str]) -> list[Span]:
        item_set = set(items)
        return _merge((m.start(), m.end()) for m in _UNIT.finditer(trace)
                      if m.group() in item_set or _ID_SHAPE.fullmatch(m.group()))

    @functools.cached_property
    def _index(self):
        return CodeIndex(list(self.inventory.codes))

    def parse_answer(self, generation: str) -> tuple[str, ...]:
        return parse_answer(generation, self._index).codes

    def metric(self, gold: Sequence[str], pred: Sequence[str]) -> dict[str, float]:
        out = set_scores(gold, pred)
        out["p_at_8"] = precision_at_k(list(pred), gold, 8)
        return out


# ------------------------------------------------------------------------------ the catalogue

def make_catalog_inventory(seed: int = 0, n_families: int = 8, *,
                           family_size: tuple[int, int] = (2, 6)) -> Inventory:
    """A seeded catalogue: ``n_families`` families (at most 17), each with 2-6 parts whose
    three-digit numbers are drawn without repeats; descriptions combine a material, a size and
    a use, distinct within a family. The prompt order is a seeded shuffle."""
    if not 2 <= n_families <= len(FAMILIES):
        raise ValueError(f"n_families must be in 2..{len(FAMILIES)}, got {n_families}")
    rng = random.Random(f"mistill-catalog-inventory-{seed}")
    fams = sorted(rng.sample(sorted(FAMILIES), n_families))
    descriptions: dict[str, str] = {}
    for fam in fams:
        noun = FAMILIES[fam][1]
        k = rng.randint(*family_size)
        numbers = sorted(rng.sample(range(100, 1000), k))
        seen: set[str] = set()
        for num in numbers:
            while True:
                desc = (f"{rng.choice(_MATERIALS).capitalize()} {noun}, {rng.choice(_SIZES)}, "
                        f"{rng.choice(_USES)}")
                if desc not in seen:
                    break
            seen.add(desc)
            descriptions[f"{fam}-{num}"] = desc
    codes = sorted(descriptions)
    random.Random(seed).shuffle(codes)
    return Inventory(codes=tuple(codes), descriptions=descriptions, order_seed=seed,
                     source="mistill.tasks.synthetic_catalog (generated)", task="catalog")


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:]


_OPEN = ("Let me read the order and work out which families of the catalogue apply.",
         "I need to match each requested part to a line of the catalogue, family by family.")
_NARROW = ("The request points to", "The order points to")
_ENUM = ("For the {p}, the candidate lines are {enum}.", "Under {L}, for the {p}, I see {enum}.")
_REJECT = ("{s} does not fit because the order does not call for the {sd}; set aside.",
           "{s} does not fit because the request describes the {gp} rather than the {sd}; set aside.")
_ENDORSE = ("So the part here is {g}.", "That leaves {g} as the part here.")
_COMPACT = ("For the {p}, {s} or {g}; {g} matches the request.",
            "{s} is close, yet the order asks for {g}.")
_DISTRACT = ("I also checked {d} ({dd}), but nothing in the order asks for it; set aside.",)
_RECAP = ("To recap, the parts are {codes}.", "Final set: {codes}.")


def _join(items: Sequence[str]) -> str:
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + f", and {items[-1]}"


def catalog_trace(gold: Sequence[str], inventory: Inventory, rng: random.Random, *,
                  n_full: int | None = None) -> str:
    """A teacher-style trace naming ``gold``: narrow to families, enumerate, reject a sibling,
    endorse, recap, then ``</think>`` and the JSON list of ``gold``. ``n_full`` parts (seeded
    2-3 if None) get the enumerate-reject-endorse treatment, the rest a compact sentence."""
    desc = inventory.descriptions
    para = {c: _lower_first(desc[c]) for c in gold}
    groups: dict[str, list[str]] = {}
    for c in gold:
        groups.setdefault(family(c), []).append(c)
    n_full = rng.randint(2, 3) if n_full is None else n_full
    full = set(rng.sample(list(gold), max(1, min(n_full, len(gold)))))
    out = ["<think>", rng.choice(_OPEN)]
    bits = [f"the {fam[0]} family ({FAMILIES.get(fam, (fam,))[0]})" for fam in groups]
    out.append(f"{rng.choice(_NARROW)} {_join(bits)}.")
    for fam, parts in groups.items():
        paragraph: list[str] = []
        for g in parts:
            sibs = list(inventory.siblings(g))
            if not sibs:
                paragraph.append(rng.choice(_ENDORSE).format(g=g))
                continue
            if g in full:
                shown = rng.sample(sibs, min(len(sibs), rng.randint(1, 2)))
                lines = sorted(shown + [g], key=inventory.index)
                enum = _join([f"{c} ({desc[c]})" if rng.random() < 0.5 else c for c in lines])
                paragraph.append(rng.choice(_ENUM).format(p=para[g], L=fam, enum=enum))
                s = rng.choice(shown)
                paragraph.append(rng.choice(_REJECT).format(s=s, sd=_lower_first(desc[s]), gp=para[g]))
                paragraph.append(rng.choice(_ENDORSE).format(g=g))
            else:
                paragraph.append(rng.choice(_COMPACT).format(p=para[g], s=rng.choice(sibs), g=g))
        out.append(" ".join(paragraph))
    other = [c for c in inventory.categories() if c not in groups]
    if other:
        d = rng.choice(inventory.codes_in_category(rng.choice(other)))
        out.append(rng.choice(_DISTRACT).format(d=d, dd=desc[d]))
    out.append(rng.choice(_RECAP).format(codes=_join(list(gold))))
    return "\n".join(out) + "\n</think>\n\n" + json.dumps(list(gold))


def _order_text(rng: random.Random, gold: Sequence[str], inventory: Inventory, index: int) -> tuple[str, str]:
    """(order text, its parts-list section: the analogue of the discharge diagnoses)."""
    desc = inventory.descriptions
    req = " ".join(f"The crew reports a worn {_lower_first(desc[c])} and asks for a replacement."
                   if rng.random() < 0.5 else f"Replace the {_lower_first(desc[c])} on line {rng.randint(1, 9)}."
                   for c in gold)
    parts_list = "Parts consumed:\n" + "\n".join(f"- {_lower_first(desc[c])}" for c in gold)
    sections = [f"Synthetic maintenance order {index + 1:03d} (generated, not a customer record)",
                f"Site: {rng.choice(('North plant', 'Depot 4', 'Harbour workshop'))}",
                "Request:\n" + req,
                "Work done:\nParts fitted and tested; line returned to service.",
                parts_list]
    return "\n\n".join(sections), parts_list


def make_catalog_corpus(n_notes: int = 8, seed: int = 0, items_range: tuple[int, int] = (3, 8), *,
                        n_families: int = 8, inventory: Inventory | None = None) -> Corpus:
    """The catalogue corpus (privacy ``"synthetic"``, name ``"catalog"``), deterministic for a
    seed: each order has ``items_range`` (inclusive, seeded) gold parts from distinct families
    (capped by the families present), a parts-list section (``Note.discharge_diagnosis``, which
    the prompt builder removes) and a scripted ``teacher_trace``. Splits: first half train, then
    val and test quarters (as the clinical generator's defaults)."""
    lo, hi = items_range
    if not 1 <= lo <= hi:
        raise ValueError(f"bad items_range {items_range}")
    if n_notes < 1:
        raise ValueError("n_notes must be positive")
    inv = inventory if inventory is not None else make_catalog_inventory(seed, n_families)

    split_of = _split_counts(n_notes, {"train": 0.5, "val": 0.25, "test": 0.25})
    fams = list(inv.categories())
    notes = []
    for i in range(n_notes):
        rng = random.Random(f"mistill-catalog-note-{seed}-{i}")
        k = min(rng.randint(lo, hi), len(fams))
        gold = [rng.choice(sorted(inv.codes_in_category(f))) for f in rng.sample(fams, k)]
        text, parts_list = _order_text(rng, gold, inv, i)
        notes.append(Note(note_id=f"cat{seed}-{i:03d}", patient_id=f"site{seed}-{i:03d}", split=split_of[i],
                          text=text, gold_codes=tuple(gold), teacher_trace=catalog_trace(gold, inv, rng),
                          discharge_diagnosis=parts_list,
                          meta={"generator": "mistill.tasks.synthetic_catalog", "seed": seed, "index": i}))
    return Corpus(name="catalog", privacy="synthetic", notes=notes, inventory=inv,
                  meta={"seed": seed, "inventory_size": len(inv), "task": "catalog"})
