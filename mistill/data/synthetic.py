"""The embedded default's corpus: seeded synthetic discharge summaries and scripted teacher traces.

Nothing here is clinical data. The inventory is a small restricted :class:`Inventory` of real
billable ICD-10-CM codes (whole categories with 2-6 billable codes, so near-misses exist, picked
from 10-14 chapter letters); each note paraphrases the descriptions of 5-25 gold codes drawn
from several chapters; each trace imitates the teacher's coarse-to-fine reasoning:

1. it narrows to regions ("The findings point to the N block (kidney and urinary) ...");
2. it enumerates candidate lines of a category, siblings of the chosen code included;
3. it names a sibling and sets it aside ("N18.1 does not fit because ...; set aside"), then
   endorses the chosen code ("So the code here is N18.9"); other codes get a shorter
   "sibling or code" treatment, a few out-of-gold lines are checked and set aside;
4. it recaps the codes and closes ``</think>`` followed by the JSON list of the gold codes.

So every trace yields every event kind the instrument extracts: P1 (the chapter letter at each
code's first mention), P2 (the later characters of first mentions), P2C (a code mentioned after
a same-category sibling, with earlier mentions of the code itself for the endorsed codes) and
prose for NULL events. At the defaults a full prompt with its trace stays under about 4,000
SmolLM2 tokens (measured in the tests with the real tokenizer).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence

from mistill.data.corpus import Corpus, Note
from mistill.data.inventory import (Inventory, _billable_table, category, chapter_letter,
                                    icd10cm_source)

__all__ = ["make_synthetic_corpus", "make_synthetic_inventory", "scripted_trace", "paraphrase",
           "REGION_NAMES", "SYNTHETIC_LETTERS"]

# Short names of the regions (chapter letters) the scripted reasoner narrows to.
REGION_NAMES: dict[str, str] = {
    "A": "infections", "B": "infections and infestations", "C": "malignant neoplasms",
    "D": "blood and benign neoplasms", "E": "endocrine, nutritional and metabolic",
    "F": "mental health",
    "G": "nervous system", "H": "eye and ear", "I": "circulatory", "J": "respiratory",
    "K": "digestive", "L": "skin", "M": "musculoskeletal", "N": "genitourinary",
    "Q": "congenital", "R": "symptoms and signs", "S": "injuries", "T": "injuries and poisoning",
    "Z": "health status",
}
# Letters the generator draws from: no pregnancy/perinatal (O, P), special-use (U) or
# external-cause (V-Y) chapters, whose codes read oddly as a patient's findings.
SYNTHETIC_LETTERS: tuple[str, ...] = tuple(REGION_NAMES)

_CODE_LIKE = re.compile(r"\b[A-Z]\d")


# ---------------------------------------------------------------------------------------------
# Inventory
# ---------------------------------------------------------------------------------------------

def _eligible_categories(max_category_size: int, max_description_chars: int,
                         letters: Sequence[str]) -> dict[str, list[str]]:
    groups: dict[str, list[tuple[str, str]]] = {}
    for code, desc in _billable_table():
        if code[0] in letters:
            groups.setdefault(category(code), []).append((code, desc))
    out: dict[str, list[str]] = {}
    for cat, rows in groups.items():
        if not 2 <= len(rows) <= max_category_size:
            continue
        if any(len(d) > max_description_chars or _CODE_LIKE.search(d) for _, d in rows):
            continue
        out[cat] = [c for c, _ in rows]
    return out


def make_synthetic_inventory(seed: int = 0, inventory_size: int = 120, *,
                             n_letters: tuple[int, int] = (10, 14), max_category_size: int = 6,
                             max_description_chars: int = 64,
                             letters: Sequence[str] = SYNTHETIC_LETTERS) -> Inventory:
    """A restricted inventory of about ``inventory_size`` real billable codes (seeded).

    Whole categories with 2..``max_category_size`` billable codes and short descriptions are
    taken round-robin from ``n_letters`` (seeded count in the range) chapter letters until the
    size is reached (it can overshoot by less than one category). The prompt order is the
    seeded shuffle of ``Inventory.billable(order_seed=seed, codes=...)``.
    """
    rng = random.Random(f"mistill-synthetic-inventory-{seed}")
    cats = _eligible_categories(max_category_size, max_description_chars, letters)
    by_letter: dict[str, list[str]] = {}
    for cat in sorted(cats):
        by_letter.setdefault(cat[0], []).append(cat)
    usable = sorted(k for k, v in by_letter.items() if len(v) >= 3)
    k = min(rng.randint(*n_letters), len(usable))
    chosen_letters = sorted(rng.sample(usable, k))
    queues = {L: rng.sample(by_letter[L], len(by_letter[L])) for L in chosen_letters}
    codes: list[str] = []
    while len(codes) < inventory_size and any(queues.values()):
        for L in chosen_letters:
            if len(codes) >= inventory_size:
                break
            if queues[L]:
                codes.extend(cats[queues[L].pop()])
    return Inventory.billable(order_seed=seed, codes=codes)


# ---------------------------------------------------------------------------------------------
# Paraphrase and phrase banks
# ---------------------------------------------------------------------------------------------

def paraphrase(description: str) -> str:
    """A finding in running text from a code description: drops "unspecified" / "NEC" and the
    capitals of ordinary words ("Chronic kidney disease, unspecified" -> "chronic kidney
    disease"); acronyms keep their capitals."""
    d = re.sub(r",?\s*\bunspecified\b", "", description, flags=re.IGNORECASE)
    d = re.sub(r",?\s*\bnot elsewhere classified\b|\s+NEC\b", "", d)
    d = re.sub(r"\s{2,}", " ", d).strip(" ,")
    words = [w.lower() if w[:1].isupper() and (w[1:].islower() or len(w) == 1) else w
             for w in d.split(" ")]
    out = " ".join(words).strip()
    return out or description.lower()


_HPI = (
    "The patient presented with {p}.",
    "The patient was admitted for evaluation of {p}.",
    "The patient came to the emergency department and was found to have {p}.",
    "Admission was prompted by {p}.",
)
_COURSE = (
    "Workup was consistent with {p}. {m}",
    "Findings confirmed {p} during the stay. {m}",
    "Known {p}, followed during the admission. {m}",
    "The team documented {p}. {m}",
    "Assessment showed {p}. {m}",
)
_MANAGE = (
    "Treated per protocol and improved.",
    "Managed with supportive care.",
    "Follow-up arranged with the outpatient team.",
    "Home regimen continued without change.",
    "Specialist input obtained and plan documented.",
    "Monitored daily and stable at discharge.",
)
_SOCIAL = (
    "Lives with family, independent at baseline, no tobacco use.",
    "Lives alone with home support; former smoker; occasional alcohol.",
    "Retired, lives with a partner, walks with a cane.",
)
_EXAM = (
    "Alert and oriented, breathing comfortably, abdomen soft, no focal deficits.",
    "Vital signs within normal limits on the ward; heart regular; lungs clear.",
    "Comfortable at rest, mild tenderness as documented, extremities warm.",
)
_RESULTS = (
    "Basic labs reviewed daily; imaging and studies as documented in the chart.",
    "Laboratory values trended toward baseline by discharge.",
    "Pertinent studies were reviewed with the patient.",
)
_DISPO = (
    "Discharge condition: stable, ambulatory, mental status clear.",
    "Discharge condition: good; tolerating diet; pain controlled.",
    "Discharge condition: improved, at baseline mobility.",
)

_OPEN = (
    "Let me read the summary and work out which regions of the list apply.",
    "I need to map each documented finding to a line of the list, region by region.",
    "First I will sort the findings into regions of the list, then pick the codes.",
)
_NARROW_HEAD = ("The findings point to", "The summary points to",
                "The documented problems point to")
_REGION_FORM = ("the {L} block ({name})", "the {L} codes ({name})", "the {L} region ({name})")
_ENUM_HEAD = (
    "For the {p}, the candidate lines are {enum}.",
    "Under {L}, for the {p}, I see {enum}.",
    "Looking at the {L} lines for the {p}: {enum}.",
)
_REJECT = (
    "{s} does not fit because the summary does not document {sd}; set aside.",
    "{s} does not fit because the note describes {gp} rather than {sd}; set aside.",
    "{s} does not fit because nothing in the summary supports {sd}; set aside.",
)
_ENDORSE = (
    "So the code here is {g}.",
    "That leaves {g} as the code here.",
    "So {g} is the code for this finding.",
)
_COMPACT = (
    "For the {p}, {s} or {g}; {g} matches what is documented.",
    "The {p} sits next to {s} in the list, but {g} is the documented one, so {g}.",
    "{s} is close, yet the note supports {g} for the {p}.",
)
_DISTRACT = (
    "I also checked {d} ({dd}), but nothing in the summary supports it; set aside.",
    "Could {d} apply? The note does not mention {dp}, so no.",
)
_RECAP = ("To recap, the codes are {codes}.", "Collecting the chosen codes: {codes}.",
          "Final set: {codes}.")


def _join(items: Sequence[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    if len(items) == 2:
        return f"{items[0]} and {items[1]}"
    return ", ".join(items[:-1]) + f", and {items[-1]}"


# ---------------------------------------------------------------------------------------------
# Notes and traces
# ---------------------------------------------------------------------------------------------

def _pick_gold(rng: random.Random, inventory: Inventory, k: int) -> list[str]:
    """``k`` gold codes from distinct categories, covering at least min(3, k) letters."""
    cats = sorted(inventory.categories())
    k = min(k, len(cats))
    by_letter: dict[str, list[str]] = {}
    for c in cats:
        by_letter.setdefault(c[0], []).append(c)
    first_letters = rng.sample(sorted(by_letter), min(3, k, len(by_letter)))
    chosen = [rng.choice(by_letter[L]) for L in first_letters]
    rest = [c for c in cats if c not in chosen]
    chosen += rng.sample(rest, k - len(chosen))
    rng.shuffle(chosen)
    return [rng.choice(sorted(inventory.codes_in_category(c))) for c in chosen]


def _note_text(rng: random.Random, gold: Sequence[str], inventory: Inventory,
               index: int) -> tuple[str, str]:
    """(note text, its discharge-diagnosis section) for the gold codes."""
    para = {c: paraphrase(inventory.descriptions[c]) for c in gold}
    n_hpi = min(len(gold), rng.randint(1, 3))
    hpi = [rng.choice(_HPI).format(p=para[c]) for c in gold[:n_hpi]]
    pmh = [c for c in gold[n_hpi:] if rng.random() < 0.3]
    course = []
    for c in gold:
        m = rng.choice(_MANAGE) if rng.random() < 0.5 else ""
        course.append(rng.choice(_COURSE).format(p=para[c], m=m).strip())
    dd_lines = [f"Primary: {para[gold[0]]}"]
    if len(gold) > 1:
        dd_lines.append("Secondary: " + "; ".join(para[c] for c in gold[1:]))
    dd = "Discharge diagnoses:\n" + "\n".join(dd_lines)
    sections = [
        f"Synthetic discharge summary {index + 1:03d} (generated, not a patient record)",
        f"Service: {rng.choice(('Medicine', 'Hospital medicine', 'General medicine'))}",
        "History of present illness:\n" + " ".join(hpi),
    ]
    if pmh:
        sections.append("Past medical history:\n" + "\n".join(f"- {para[c]}" for c in pmh))
    sections += [
        "Social history:\n" + rng.choice(_SOCIAL),
        "Physical exam:\n" + rng.choice(_EXAM),
        "Pertinent results:\n" + rng.choice(_RESULTS),
        "Hospital course:\n" + "\n".join(course),
        dd,
        rng.choice(_DISPO),
        "Discharge instructions:\nReturn if symptoms worsen; keep follow-up appointments.",
    ]
    return "\n\n".join(sections), dd


def scripted_trace(gold: Sequence[str], inventory: Inventory, rng: random.Random, *,
                   n_full: int | None = None, n_distractors: int | None = None) -> str:
    """A teacher-style trace for ``gold``: narrow, enumerate, reject a sibling, endorse, recap,
    then ``</think>`` and the JSON list of ``gold``.

    n_full: how many codes get the full enumerate-reject-endorse treatment (seeded 3-5 if
    None; at least 1). The rest get the compact "sibling or code" sentence. n_distractors:
    out-of-gold lines checked and set aside (seeded 1-2 if None).
    """
    desc = inventory.descriptions
    para = {c: paraphrase(desc[c]) for c in gold}
    n_full = rng.randint(3, 5) if n_full is None else n_full
    n_full = max(1, min(n_full, len(gold)))
    # Group the codes by region, regions in order of first appearance in the gold list.
    regions: dict[str, list[str]] = {}
    for c in gold:
        regions.setdefault(chapter_letter(c), []).append(c)
    full = set(rng.sample(list(gold), n_full))
    out: list[str] = ["<think>", rng.choice(_OPEN)]
    # Region names only, with the finding spelled out for the first two regions (keeps the
    # narrowing sentence short when a note spans many letters).
    region_bits = [rng.choice(_REGION_FORM).format(L=L, name=REGION_NAMES.get(L, "other"))
                   + (f" for the {para[cs[0]]}" if i < 2 else "")
                   for i, (L, cs) in enumerate(regions.items())]
    out.append(f"{rng.choice(_NARROW_HEAD)} {_join(region_bits)}.")
    gold_cats = {category(c) for c in gold}
    for L, codes in regions.items():
        paragraph: list[str] = []
        for g in codes:
            sibs = list(inventory.siblings(g))
            if g in full:
                shown = rng.sample(sibs, min(len(sibs), rng.randint(1, 3)))
                lines = sorted(shown + [g], key=inventory.index)
                enum = _join([f"{c} ({desc[c]})" if rng.random() < 0.5 else c for c in lines])
                paragraph.append(rng.choice(_ENUM_HEAD).format(p=para[g], L=L, enum=enum))
                s = rng.choice(shown)
                paragraph.append(rng.choice(_REJECT).format(s=s, sd=paraphrase(desc[s]),
                                                            gp=para[g]))
                paragraph.append(rng.choice(_ENDORSE).format(g=g))
            else:
                s = rng.choice(sibs)
                paragraph.append(rng.choice(_COMPACT).format(p=para[g], s=s, g=g))
        out.append(" ".join(paragraph))
    others = [c for c in inventory.categories() if c not in gold_cats]
    n_d = rng.randint(1, 2) if n_distractors is None else n_distractors
    for cat in rng.sample(others, min(n_d, len(others))):
        d = rng.choice(inventory.codes_in_category(cat))
        out.append(rng.choice(_DISTRACT).format(d=d, dd=desc[d], dp=paraphrase(desc[d])))
    out.append(rng.choice(_RECAP).format(codes=_join(list(gold))))
    return "\n".join(out) + "\n</think>\n\n" + json.dumps(list(gold))


def _split_counts(n: int, fractions: Mapping[str, float]) -> list[str]:
    """Split label per note index: largest-remainder counts, in the mapping's order."""
    total = sum(fractions.values())
    raw = {k: n * v / total for k, v in fractions.items()}
    counts = {k: int(v) for k, v in raw.items()}
    left = n - sum(counts.values())
    for k in sorted(raw, key=lambda k: (-(raw[k] - counts[k]), list(raw).index(k)))[:left]:
        counts[k] += 1
    return [k for k in fractions for _ in range(counts[k])]


def make_synthetic_corpus(n_notes: int = 8, seed: int = 0,
                          n_codes_range: tuple[int, int] = (5, 25), inventory_size: int = 120,
                          *, splits: Mapping[str, float] | None = None,
                          inventory: Inventory | None = None) -> Corpus:
    """The embedded default's corpus (privacy ``"synthetic"``, name ``"synthetic"``).

    Each note has ``n_codes_range`` (inclusive, seeded) gold codes from distinct categories and at
    least three chapter letters, a discharge-diagnosis section recorded in
    ``Note.discharge_diagnosis`` and a scripted ``teacher_trace`` whose final JSON list equals
    ``gold_codes``. The inventory (``corpus.inventory``) is
    ``make_synthetic_inventory(seed, inventory_size)`` unless given. ``splits`` maps split name to
    fraction (default train 0.5, val 0.25, test 0.25), assigned in note order. Deterministic
    for a seed.
    """
    lo, hi = n_codes_range
    if not 1 <= lo <= hi:
        raise ValueError(f"bad n_codes_range {n_codes_range}")
    if n_notes < 1:
        raise ValueError("n_notes must be positive")
    inv = inventory if inventory is not None else make_synthetic_inventory(seed, inventory_size)
    split_of = _split_counts(n_notes, splits or {"train": 0.5, "val": 0.25, "test": 0.25})
    notes: list[Note] = []
    for i in range(n_notes):
        rng = random.Random(f"mistill-synthetic-note-{seed}-{i}")
        gold = _pick_gold(rng, inv, rng.randint(lo, hi))
        text, dd = _note_text(rng, gold, inv, i)
        trace = scripted_trace(gold, inv, rng)
        notes.append(Note(note_id=f"syn{seed}-{i:03d}", patient_id=f"synp{seed}-{i:03d}",
                          split=split_of[i], text=text, gold_codes=tuple(gold),
                          teacher_trace=trace, discharge_diagnosis=dd,
                          meta={"generator": "mistill.data.synthetic", "seed": seed,
                                "index": i}))
    return Corpus(name="synthetic", privacy="synthetic", notes=notes, inventory=inv,
                  meta={"seed": seed, "inventory_size": len(inv), "source": icd10cm_source()})
