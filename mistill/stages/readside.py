"""The ``read_side`` stage: what the decision heads read (paper App. E; Tables 16-19).

On an ``attribute`` run's notes, with its global rankings: a fixed **panel** (the global top-k of
each phase, the bottom-k of the chapter and contrastive rankings, k seeded random heads). One
prefill per note, then each panel head's causal attention row at every P1, P2 and P2C event from
the prefix's keys and the events' queries (:func:`~mistill.instrument.readside.prefix_attention_rows`);
each row is split over the 15 key categories (:mod:`mistill.instrument.keycats`), with the
region lift and ``n_eff`` over inventory tokens, beside the head's measured importance at that
event from the attribute run (exact where patched, first order elsewhere).

Reported (medians over notes of per-note values):

- ``readside_groups`` (Table 16): per phase, the region lift of the top-k, the random panel and
  the bottom-k (per note: the median over events per head, then the mean over heads), the notes
  on which the top-k's lift beats the random panel's with the sign test, and the top-k's shares on
  the sink, the inventory lines, the note, the trace prose and the code prefix;
- ``readside_note_lifts``: each note's region lift per phase and group, the values Table 16's
  medians are taken over (the report collapses them to patients, App. C "Patients");
- ``readside_readback_notes``: the earlier-naming read-back diagnostic's per-input values (App. P,
  Table 59; the clinical Table 19's ``N`` share): per note and group (``top``, ``random``,
  ``bottom``), the mean share on ``N`` (the earlier namings of the alternative) over the note's
  P2C events and the group's heads. With ``sets_run`` the panel comes from a frozen ranking of
  another run (the development batch), read on this run's inputs;
- ``readside_heads_<phase>`` (Tables 17-19): per head of the phase's top-k, its ``I_c``, shares
  on the region, the prose and the sink, region lift, ``n_eff``, ``r`` (Pearson across the head's
  events over all notes between its share on the region, on ``N`` at P2C, and its importance), and
  its family by the rule of ``ReadSideConfig``.

Descriptive: attention is not intervened on here (key blocking is :mod:`mistill.instrument.keyblock`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mistill.config import Config
from mistill.distill.buckets import build_axis, token_buckets
from mistill.distributed import current_world
from mistill.errors import MistillInputError
from mistill.evaluation.own_heads import random_panel
from mistill.instrument.keycats import KEY_CATEGORIES, REGION_CATEGORIES, key_categories, read_measures
from mistill.instrument.passes import PHASES, NoteAttribution
from mistill.instrument.readside import note_region_lift, prefix_attention_rows
from mistill.instrument.runner import Runner
from mistill.io import npz_bytes
from mistill.params import ChunkParams
from mistill.stages.characterize import (attribute_input, check_ranked_heads, ranking_sets, ranks_from_head_sets,
                                         read_realized)
from mistill.stages.common import load_model, prepared_note_input, subject_run_args
from mistill.stages.runner import WrittenNotes, note_loop, notes_written, open_stage, stage_device
from mistill.stats import sign_test
from mistill.tasks import note_items, task_for
from mistill.validation import (check_device, check_dtype, check_interval, check_no_text_fields, check_non_negative,
                                check_positive, check_run_id, check_seed)

NOTES = "notes"
FAMILIES = ("region reader", "prose reader", "mixed")
NOTE_LIFTS = "readside_note_lifts"
"""The run's table of each note's region lift per phase and group (:func:`note_lift_rows`): the
per-note values behind Table 16, which the report collapses to patients (App. C)."""
READBACK_NOTES = "readside_readback_notes"
"""The run's table of the read-back diagnostic's per-input values (:func:`readback_rows`)."""
READBACK_PHASE = "P2C"
"""The decision whose heads' reading of the alternative's earlier namings (``N``) is compared."""


@dataclass(frozen=True)
class ReadSideConfig(Config, ChunkParams):
    """The read side of a ranked model's heads (App. E).

    attribute_run: the ``attribute`` run whose notes are read (and, without ``sets_run``, its
        global rankings).
    sets_run: another ``attribute`` run of the same model whose global rankings give the panel
        (empty: ``attribute_run``'s own): App. P reads a development batch's frozen ranking on
        the assessment batch and on fresh inputs, with panels of 40 (``-P panel_top=40
        -P panel_bottom=40 -P panel_random=40``).
    panel_top / panel_bottom / panel_random: the panel's global top-k of each phase, bottom-k of
    the chapter (P1) and contrastive (P2C) rankings, and seeded random heads (the paper: 16 each).
    region_reader_lift, region_reader_share: **[recon]** a head is a region reader when its median
    region lift reaches the first and its median share on the region the second;
    prose_reader_share: **[recon]** else a prose reader when its median share on the trace prose
    reaches this; else mixed (the paper calls the boundary a judgement call and gives the numbers).
    """

    attribute_run: str = ""
    sets_run: str = ""
    panel_top: int = 16
    panel_bottom: int = 16
    panel_random: int = 16
    region_reader_lift: float = 4.0
    region_reader_share: float = 0.2
    prose_reader_share: float = 0.5
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.attribute_run, "attribute_run")
        check_run_id(self.sets_run, "sets_run")
        for name in ("panel_top", "panel_bottom", "panel_random"):
            check_non_negative(getattr(self, name), name)
        check_positive(self.panel_top, "panel_top")
        check_positive(self.region_reader_lift, "region_reader_lift")
        check_interval(self.region_reader_share, "region_reader_share")
        check_interval(self.prose_reader_share, "prose_reader_share")
        check_dtype(self.dtype)
        check_device(self.device)
        check_seed(self.seed)


def panel_groups(rank: dict[str, list[int]], head_sets: dict, names: list[str],
                 cfg: ReadSideConfig) -> dict[str, list[int]]:
    """The panel's groups, ``{name: flat heads}``: ``top_<phase>`` for each ranked phase,
    ``bottom_P1`` / ``bottom_P2C`` (the calibration's bottom-k where it lists that k, else the
    ranking's last k), ``random``."""
    index = {n: i for i, n in enumerate(names)}
    groups = {f"top_{p}": list(rank[p][:cfg.panel_top]) for p in PHASES if p in rank}
    for p in ("P1", "P2C"):
        if p in rank and cfg.panel_bottom:
            listed = head_sets.get(p, {}).get("bottom", {}).get(str(cfg.panel_bottom))
            groups[f"bottom_{p}"] = ([index[n] for n in listed] if listed is not None
                                     else list(rank[p][::-1][:cfg.panel_bottom]))
    if cfg.panel_random:
        groups["random"] = random_panel(len(names), cfg.panel_random, cfg.seed)
    return groups


def family(lift: float, region: float, prose: float, cfg: ReadSideConfig) -> str:
    """A head's family from its median region lift and shares (the rule of :class:`ReadSideConfig`)."""
    if math.isfinite(lift) and lift >= cfg.region_reader_lift and region >= cfg.region_reader_share:
        return "region reader"
    if prose >= cfg.prose_reader_share:
        return "prose reader"
    return "mixed"


def run_read_side(cfg: ReadSideConfig) -> str:
    source = attribute_input(cfg.attribute_run)
    att_reader, ev, prepared, notes = source.reader, source.events, source.prepared, source.notes
    head_sets = ranking_sets(cfg.attribute_run, cfg.sets_run)
    inputs = {"attribute": cfg.attribute_run, **({"sets": cfg.sets_run} if cfg.sets_run else {})}
    with open_stage("read_side", cfg, prepared, inputs=inputs, **subject_run_args(ev.model)) as run:
        if run.reused:
            return run.run_id
        lm = load_model(ev.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        runner = Runner(lm, chunk_size=cfg.chunk_size)
        names = lm.geometry.head_names()
        check_ranked_heads(head_sets, names, "sets_run" if cfg.sets_run else "attribute_run")
        rank = ranks_from_head_sets(head_sets, names)
        if not rank:
            raise MistillInputError(f"the attribute run {cfg.attribute_run} has no phase ranking",
                                    field="attribute_run")
        groups = panel_groups(rank, head_sets, names, cfg)
        panel = sorted({h for heads in groups.values() for h in heads})
        if current_world().leader:
            run.log_json("readside_panel.json", {"panel": [names[h] for h in panel],
                                                 **{g: [names[h] for h in hs] for g, hs in groups.items()}})
        task = task_for(prepared.inventory)
        for note in note_loop(run, NOTES, notes, desc="read side"):
            codes, note_task = note_items(prepared.inventory, note), task.for_note(note)
            ni = prepared_note_input(prepared, note, lm.tokenizer)
            realized = [r for r in read_realized(ev.reader, note.note_id) if r.event.kind in PHASES]
            att = NoteAttribution.from_npz(att_reader.note_file(NOTES, note.note_id, "attribution.npz"),
                                           note.note_id)
            row_of = {e: i for i, e in enumerate(att.event_ids)}
            axis = build_axis(ni.prompt, ni.trace)
            base = token_buckets(axis, ni.prompt, ni.offsets, len(ni.trace))
            prefix, _ = runner.prefill(ni.input_ids)
            rows = prefix_attention_rows(runner, prefix, [r.position for r in realized], panel)
            del prefix
            shares = np.zeros((len(realized), len(panel), len(KEY_CATEGORIES)))
            lift = np.full((len(realized), len(panel)), np.nan)
            n_eff = np.full((len(realized), len(panel)), np.nan)
            importance = np.full((len(realized), len(panel)), np.nan)
            for i, r in enumerate(realized):
                cats = key_categories(axis, base, ni.prompt, ni.offsets, r, ni.trace, codes, task=note_task)
                m = read_measures(rows[i], cats, r.position)
                shares[i], lift[i], n_eff[i] = m["shares"], m["region_lift"], m["n_eff"]
                if r.event.event_id in row_of:
                    importance[i] = att.importance[row_of[r.event.event_id], panel]
            run.write_note(NOTES, note.note_id, {"readside.npz": npz_bytes({
                "event_ids": np.array([r.event.event_id for r in realized], dtype=str),
                "kinds": np.array([r.event.kind for r in realized], dtype=str),
                "shares": shares, "region_lift": lift, "n_eff": n_eff, "importance": importance})})
        if not notes_written(run, NOTES, notes):
            return run.run_id
        reader = WrittenNotes(run, NOTES)
        per_note = {note.note_id: reader.npz(note.note_id, "readside.npz") for note in notes}
        ic = {p: dict(zip(head_sets[p]["ranking"], head_sets[p].get("importance_c", []))) for p in rank}
        groups_table = group_table(per_note, panel, groups)
        run.log_table("readside_groups", groups_table)
        run.log_table(NOTE_LIFTS, note_lift_rows(per_note, panel, groups))
        run.log_table(READBACK_NOTES, readback_rows(per_note, panel, groups))
        metrics = {}
        for _, row in groups_table.iterrows():
            for col in ("lift_top", "lift_random", "lift_bottom", "top_beats_random_p"):
                if pd.notna(row[col]):
                    metrics[f"readside/{row['phase']}/{col}"] = float(row[col])
        for p in rank:
            heads = head_table(per_note, panel, groups[f"top_{p}"], p, names, ic.get(p, {}), cfg)
            run.log_table(f"readside_heads_{p}", heads)
            for fam in FAMILIES:
                metrics[f"readside/{p}/n_{fam.replace(' ', '_')}"] = float((heads["family"] == fam).sum())
        run.log_metrics(metrics)
        print(f"read_side: {len(notes)} notes, a panel of {len(panel)} heads -> run {run.run_id}")
        return run.run_id


def _cat(name: str) -> int:
    return KEY_CATEGORIES.index(name)


def _region(shares: np.ndarray) -> np.ndarray:
    return shares[..., [_cat(c) for c in REGION_CATEGORIES]].sum(-1)


def _lines(shares: np.ndarray) -> np.ndarray:
    return _region(shares) + shares[..., _cat("other_chapter_lines")]


GROUPS: tuple[str, ...] = ("top", "random", "bottom")
"""The panel's groups whose region lift is compared (Table 16): the phase's global top-k, the
seeded random heads and the phase's bottom-k."""


def phase_groups(groups: dict[str, list[int]], phase: str) -> dict[str, list[int]]:
    """The heads of each of :data:`GROUPS` for ``phase`` (empty where the panel has none: there is
    no bottom-k of P2)."""
    return {"top": groups.get(f"top_{phase}", []), "random": groups.get("random", []),
            "bottom": groups.get(f"bottom_{phase}", [])}


def note_lift_rows(per_note: dict[str, dict], panel: list[int], groups: dict[str, list[int]]) -> pd.DataFrame:
    """Each note's region lift per phase and group (``note_id, phase, group, lift``): the median
    over the phase's events per head, then the mean over the group's heads
    (:func:`~mistill.instrument.readside.note_region_lift`); a note without events of a phase has
    no rows for it, a group without heads (the bottom-k of P2) a NaN lift."""
    col = {h: j for j, h in enumerate(panel)}
    rows = []
    for phase in PHASES:
        if f"top_{phase}" not in groups:
            continue
        heads_of = phase_groups(groups, phase)
        for note_id, d in per_note.items():
            ev = d["kinds"] == phase
            if not ev.any():
                continue
            for name in GROUPS:
                rows.append({"note_id": note_id, "phase": phase, "group": name,
                             "lift": note_region_lift(d["region_lift"][ev][:, [col[h] for h in heads_of[name]]])})
    return pd.DataFrame(rows, columns=["note_id", "phase", "group", "lift"])


def readback_rows(per_note: dict[str, dict], panel: list[int], groups: dict[str, list[int]]) -> pd.DataFrame:
    """The earlier-naming read-back diagnostic's per-input values (``note_id, group, n_share,
    n_events``): per note with :data:`READBACK_PHASE` events and per group (``top``, ``random``,
    ``bottom``: the phase's top-k, the seeded random heads, its bottom-k), the mean over those
    events and the group's heads of the share on ``N``. A group the panel lacks has no rows; a
    note without such events none."""
    col = {h: j for j, h in enumerate(panel)}
    heads_of = phase_groups(groups, READBACK_PHASE)
    rows = []
    for note_id, d in per_note.items():
        ev = d["kinds"] == READBACK_PHASE
        if not ev.any():
            continue
        for name in GROUPS:
            if heads_of[name]:
                share = d["shares"][ev][:, [col[h] for h in heads_of[name]], _cat("N")]
                rows.append({"note_id": note_id, "group": name, "n_share": float(share.mean()),
                             "n_events": int(ev.sum())})
    return pd.DataFrame(rows, columns=["note_id", "group", "n_share", "n_events"])


def group_table(per_note: dict[str, dict], panel: list[int], groups: dict[str, list[int]]) -> pd.DataFrame:
    """Table 16: per phase, the region lift of the top-k, random and bottom-k groups (medians over
    notes of :func:`note_lift_rows`), the notes on which the top-k beats the random panel, and the
    top-k's shares."""
    col = {h: j for j, h in enumerate(panel)}
    lifts_of = note_lift_rows(per_note, panel, groups)
    out = []
    for phase in PHASES:
        top = groups.get(f"top_{phase}")
        here = lifts_of[lifts_of["phase"] == phase]
        if top is None or here.empty:
            continue
        wide = here.pivot(index="note_id", columns="group", values="lift")
        lifts = {name: wide[name].to_numpy(dtype=float) for name in GROUPS}
        shares: dict[str, list[float]] = {k: [] for k in ("sink", "lines", "note", "prose", "prefix")}
        for d in per_note.values():
            ev = d["kinds"] == phase
            if not ev.any():
                continue
            s = d["shares"][ev][:, [col[h] for h in top]]
            for key, vals in (("sink", s[..., _cat("sink")]), ("lines", _lines(s)), ("note", s[..., _cat("note")]),
                              ("prose", s[..., _cat("prose")]), ("prefix", s[..., _cat("prefix")])):
                shares[key].append(float(np.nanmean(vals)))
        a, b = lifts["top"], lifts["random"]
        ok = np.isfinite(a) & np.isfinite(b) & (a != b)
        wins, losses = int((a[ok] > b[ok]).sum()), int((a[ok] < b[ok]).sum())
        out.append({"phase": phase, "n_notes": len(wide),
                    **{f"lift_{k}": float(np.nanmedian(v)) if np.isfinite(v).any() else np.nan
                       for k, v in lifts.items()},
                    "top_beats_random": wins, "top_below_random": losses,
                    "top_beats_random_p": sign_test(wins, losses) if wins + losses else np.nan,
                    **{f"top_share_{k}": float(np.nanmedian(v)) for k, v in shares.items()}})
    return pd.DataFrame(out)


def head_table(per_note: dict[str, dict], panel: list[int], top: list[int], phase: str, names: list[str],
               ic: dict[str, float], cfg: ReadSideConfig) -> pd.DataFrame:
    """Tables 17-19: the phase's top-k head by head at the phase's events."""
    col = {h: j for j, h in enumerate(panel)}
    rows = []
    for h in top:
        j = col[h]
        region, prose, sink, lifts, neffs, xs, ys = [], [], [], [], [], [], []
        for d in per_note.values():
            ev = d["kinds"] == phase
            if not ev.any():
                continue
            s = d["shares"][ev][:, j]
            region.append(float(np.mean(_region(s))))
            prose.append(float(np.mean(s[:, _cat("prose")])))
            sink.append(float(np.mean(s[:, _cat("sink")])))
            lifts.append(float(np.nanmedian(d["region_lift"][ev][:, j])) if np.isfinite(d["region_lift"][ev][:, j]).any()
                         else np.nan)
            neffs.append(float(np.nanmean(d["n_eff"][ev][:, j])) if np.isfinite(d["n_eff"][ev][:, j]).any() else np.nan)
            read = s[:, _cat("N")] if phase == "P2C" else _region(s)
            xs += read.tolist()
            ys += d["importance"][ev][:, j].tolist()
        if not region:
            continue
        x, y = np.asarray(xs), np.asarray(ys)
        ok = np.isfinite(x) & np.isfinite(y)
        r = float(np.corrcoef(x[ok], y[ok])[0, 1]) if ok.sum() >= 3 and x[ok].std() > 0 and y[ok].std() > 0 \
            else float("nan")
        med = {k: float(np.nanmedian(v)) if np.isfinite(v).any() else float("nan")
               for k, v in (("region", np.asarray(region)), ("prose", np.asarray(prose)), ("sink", np.asarray(sink)),
                            ("lift", np.asarray(lifts)), ("n_eff", np.asarray(neffs)))}
        rows.append({"head": names[h], "I_c": ic.get(names[h], float("nan")), "share_region": med["region"],
                     "share_prose": med["prose"], "share_sink": med["sink"], "region_lift": med["lift"],
                     "n_eff": med["n_eff"], "r": r,
                     "family": family(med["lift"], med["region"], med["prose"], cfg)})
    return pd.DataFrame(rows)


__all__ = ["ReadSideConfig", "run_read_side", "panel_groups", "family", "note_lift_rows", "group_table", "head_table",
           "FAMILIES", "GROUPS", "NOTE_LIFTS"]
