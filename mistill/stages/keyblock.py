"""The ``key_block`` stage: does a read-side head act through what it reads? (paper App. E,
"Blocking what the heads read"; Table 20).

On a ``read_side`` run's notes, each **named head** is prevented from attending to the key
positions it is named for (:data:`~mistill.instrument.keyblock.KEY_SETS`) at the decision token,
the rest of its softmax renormalised, every other head and layer unchanged
(:func:`~mistill.instrument.keyblock.key_block`). Per event and head:

- ``E``: the head's whole effect, clean margin minus its mean-ablated margin at the same token;
- ``D_named``: the margin lost when the head cannot attend to the named keys, against the
  reference that runs the same masked path with an empty key set (so kernel noise cancels);
- ``D_control``: the same with a matched control, as many keys of other chapters' whole lines
  (line sets) or other codes' whole earlier mentions (mention sets), drawn with a seed per
  event, head and set (:func:`~mistill.instrument.keyblock.matched_control`).

Which heads: ``heads`` names them (``L30H11:N+near_miss_line,L28H21:region``); left empty, the
read-side run's families choose (**[recon]**: the paper names its three heads by hand): the
P1 top-k's region readers, at most ``region_heads``, named for ``region``, and the
``loopback_heads`` heads of the P2C top-k that put the most attention on the earlier mentions
of the near-miss (median over notes), named for ``N`` and ``near_miss_line``.

Table ``key_block`` (Table 20), per head and key set: events, median ``E`` and the share of
events with ``E > min_effect``, median ``D`` of the named and control keys, the median share
``D / E`` over events with ``E > min_effect``, and per note the mean of named minus control with
its bootstrap interval, notes higher / lower and the sign test.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mistill.config import Config
from mistill.distill.buckets import build_axis, token_buckets
from mistill.errors import MistillInputError
from mistill.instrument.hooks import HeadHook
from mistill.instrument.inputs import event_queries
from mistill.instrument.keyblock import KEY_SETS, key_block, matched_control, named_keys
from mistill.instrument.keycats import KEY_CATEGORIES, key_categories
from mistill.instrument.passes import prefill_note, seeded_subset, stable_seed
from mistill.instrument.patching import clean_read, mean_ablate
from mistill.instrument.runner import Runner
from mistill.io import dumps
from mistill.params import ChunkParams
from mistill.progress import get_logger
from mistill.stages.characterize import attribute_input, read_realized
from mistill.stages.common import RunReader, load_model, prepared_note_input, subject_run_args
from mistill.stages.runner import WrittenNotes, note_loop, notes_written, open_stage, stage_device
from mistill.stats import difference_tests
from mistill.tasks import note_items, task_for
from mistill.validation import (check_device, check_dtype, check_no_text_fields, check_non_negative, check_pattern,
                                check_run_id, check_seed)

NOTES = "notes"
_log = get_logger("key_block")
_HEAD_SPEC = re.compile(r"^L\d+H\d+:[A-Za-z_]+(\+[A-Za-z_]+)*$")


@dataclass(frozen=True)
class KeyBlockConfig(Config, ChunkParams):
    """Key-side blocking of named read-side heads (App. E, Table 20).

    read_side_run: the ``read_side`` run whose notes, model and head families are used.
    heads: named heads and their key sets, ``L30H11:N+near_miss_line,L28H21:region`` (sets of
    :data:`~mistill.instrument.keyblock.KEY_SETS`); empty: chosen from the read-side run.
    region_heads / loopback_heads: **[recon]** how many heads the empty ``heads`` takes: the P1
    top-k's region readers (in ranking order) and the P2C top-k's heads with the largest median
    share on the near-miss's earlier mentions.
    max_events: at most this many events per note and phase, seeded (0: every event, as the paper).
    min_effect: the events whose ``E`` exceeds it give the shares ``D / E`` (the paper: 0.1 nats).
    """

    read_side_run: str = ""
    heads: str = ""
    region_heads: int = 2
    loopback_heads: int = 2
    max_events: int = 0
    min_effect: float = 0.1
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.read_side_run, "read_side_run")
        for item in filter(None, (s.strip() for s in self.heads.split(","))):
            check_pattern(item, _HEAD_SPEC, "heads", "HEAD:SET[+SET] (e.g. L30H11:N+near_miss_line)")
            for name in item.split(":")[1].split("+"):
                if name not in KEY_SETS:
                    raise MistillInputError(f"unknown key set {name!r} in heads; one of {sorted(KEY_SETS)}",
                                            field="heads")
        for name in ("region_heads", "loopback_heads", "max_events"):
            check_non_negative(getattr(self, name), name)
        check_non_negative(self.min_effect, "min_effect")
        check_dtype(self.dtype)
        check_device(self.device)
        check_seed(self.seed)


def parse_heads(spec: str) -> list[tuple[str, str]]:
    """``"L30H11:N+near_miss_line,L28H21:region"`` -> ``[(head, key set), ...]`` in the order given."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        head, sets = item.split(":")
        out += [(head, name) for name in sets.split("+")]
    return out


def chosen_heads(read_side: RunReader, notes: list[str], cfg: KeyBlockConfig) -> list[tuple[str, str]]:
    """The named heads of an empty ``heads``, from the read-side run (see :class:`KeyBlockConfig`)."""
    out: list[tuple[str, str]] = []
    if cfg.region_heads:
        try:
            table = pd.read_csv(read_side.file("readside_heads_P1.csv"))
        except MistillInputError:
            table = pd.DataFrame(columns=["head", "family"])
        readers = [str(h) for h in table.loc[table["family"] == "region reader", "head"]][:cfg.region_heads]
        out += [(h, "region") for h in readers]
    panel = json.loads(read_side.file("readside_panel.json").read_text())
    top = panel.get("top_P2C", [])
    if cfg.loopback_heads and top:
        col = {h: j for j, h in enumerate(panel["panel"])}
        n_cat = KEY_CATEGORIES.index("N")
        per_note = []
        for note_id in notes:
            with np.load(read_side.note_file(NOTES, note_id, "readside.npz")) as d:
                ev = d["kinds"] == "P2C"
                if ev.any():
                    per_note.append([float(d["shares"][ev][:, col[h], n_cat].mean()) for h in top])
        if per_note:
            median = np.median(np.asarray(per_note), axis=0)
            order = sorted(range(len(top)), key=lambda j: (-median[j], j))  # ties: ranking order
            for j in order[:cfg.loopback_heads]:
                out += [(top[j], "N"), (top[j], "near_miss_line")]
    return out


def block_note(runner, hook, ni, picked: list, named: list, codes: list[str], cfg: KeyBlockConfig,
               task=None) -> list[dict]:
    """One note's rows: every named (head, key set) at each picked event of its phases, after one
    prefill (``named``: ``(flat head, head name, KeySet)``; ``task``: the label space,
    :func:`mistill.tasks.task_for`)."""
    axis = build_axis(ni.prompt, ni.trace)
    base = token_buckets(axis, ni.prompt, ni.offsets, len(ni.trace))
    prefix, mean = prefill_note(runner, hook, ni.input_ids)
    rows = []
    for r, eq in zip(picked, event_queries(picked, ni.input_ids)):
        cats = key_categories(axis, base, ni.prompt, ni.offsets, r, ni.trace, codes, task=task)
        clean = None
        for head, name, ks in named:
            if r.event.kind not in ks.phases:
                continue
            keys = named_keys(cats, r.position, ks)
            if not keys or len(keys) > r.position:  # nothing named here, or no key would be left
                continue
            if clean is None:
                clean = clean_read(runner, hook, prefix, eq.query)
            control = matched_control(cats, base, r.position, ks, len(keys),
                                      stable_seed(cfg.seed, ni.note.note_id, r.event.event_id, name, ks.name))
            sets = [[], keys] + ([control] if control is not None else [])
            m = key_block(runner, hook, prefix, eq.query, clean.hidden_in, head, sets)
            ablated = float(mean_ablate(runner, hook, prefix, eq.query, [[head]], mean, hidden_in=clean.hidden_in)[0])
            ref = float(m[0])
            rows.append({"event_id": r.event.event_id, "kind": r.event.kind, "head": name, "key_set": ks.name,
                         "n_keys": len(keys), "clean": clean.margin, "reference": ref,
                         "E": clean.margin - ablated, "D_named": ref - float(m[1]),
                         "D_control": ref - float(m[2]) if control is not None else None})
    return rows


def run_key_block(cfg: KeyBlockConfig) -> str:
    rs = RunReader(cfg.read_side_run, field="read_side_run")
    if rs.tags.get("mistill.stage") != "read_side":
        raise MistillInputError(f"run {cfg.read_side_run} is a {rs.tags.get('mistill.stage')!r} run, not read_side",
                                field="read_side_run")
    att = attribute_input(rs.config["attribute_run"], field="read_side_run")
    ev, prepared, notes = att.events, att.prepared, att.notes
    pairs = parse_heads(cfg.heads) if cfg.heads else chosen_heads(rs, [n.note_id for n in notes], cfg)
    if not pairs:
        _log.warning("key_block: the read_side run %s names no head (no region reader at P1, no P2C ranking); "
                     "the run records no blocking (name heads with heads=L30H11:N,...)", cfg.read_side_run)
    with open_stage("key_block", cfg, prepared, inputs={"read_side": cfg.read_side_run},
                    **subject_run_args(ev.model)) as run:
        if run.reused:
            return run.run_id
        lm = load_model(ev.model, dtype=cfg.dtype, device=stage_device(cfg.device))
        g = lm.geometry
        named = [(g.head_index(h), h, KEY_SETS[s]) for h, s in pairs]
        run.log_json("key_block_heads.json", {"heads": [{"head": h, "key_set": ks.name, "phases": list(ks.phases),
                                                          "control": ks.control} for _, h, ks in named]})
        phases = sorted({p for _, _, ks in named for p in ks.phases})  # none: every note records no row
        runner, hook = Runner(lm, chunk_size=cfg.chunk_size), HeadHook(g)
        task = task_for(prepared.inventory)
        for note in note_loop(run, NOTES, notes, desc="key block"):
            codes = note_items(prepared.inventory, note)
            ni = prepared_note_input(prepared, note, lm.tokenizer)
            realized = read_realized(ev.reader, note.note_id)
            picked = [r for p in phases
                      for r in seeded_subset([r for r in realized if r.event.kind == p], cfg.max_events, cfg.seed,
                                             note.note_id, p)]
            rows = block_note(runner, hook, ni, picked, named, codes, cfg, task.for_note(note)) \
                if picked else []
            run.write_note(NOTES, note.note_id, {"key_block.jsonl": "".join(dumps(r) + "\n" for r in rows)})
        if not notes_written(run, NOTES, notes):
            return run.run_id
        reader = WrittenNotes(run, NOTES)
        per_event = pd.DataFrame([{**row, "note_id": note.note_id} for note in notes
                                  for row in reader.jsonl(note.note_id, "key_block.jsonl")])
        table = key_block_table(per_event, [(h, ks.name) for _, h, ks in named], cfg.min_effect, seed=cfg.seed)
        run.log_table("key_block", table)
        metrics = {}
        for _, row in table.iterrows():
            for col in ("share_named", "share_control", "named_minus_control", "sign_p"):
                if pd.notna(row[col]):
                    metrics[f"key_block/{row['head']}/{row['key_set']}/{col}"] = float(row[col])
        run.log_metrics(metrics)
        print(f"key_block: {len(notes)} notes, {len(named)} head x key set -> run {run.run_id}")
        return run.run_id


def key_block_table(per_event: pd.DataFrame, pairs: list[tuple[str, str]], min_effect: float, *,
                    seed: int = 0) -> pd.DataFrame:
    """Table 20 from per-event rows (columns ``note_id, head, key_set, E, D_named, D_control``),
    one row per (head, key set) in ``pairs``' order."""
    out = []
    for head, key_set in pairs:
        d = per_event[(per_event["head"] == head) & (per_event["key_set"] == key_set)] if len(per_event) else per_event
        row: dict = {"head": head, "key_set": key_set, "n_events": len(d), "n_notes": 0}
        if not len(d):
            out.append(row)
            continue
        E = d["E"].to_numpy(float)
        named = d["D_named"].to_numpy(float)
        control = pd.to_numeric(d["D_control"], errors="coerce").to_numpy(float)
        big = E > min_effect
        with np.errstate(invalid="ignore", divide="ignore"):
            share_named, share_control = named[big] / E[big], control[big] / E[big]
        diffs = (d.assign(diff=named - control).dropna(subset=["diff"]).groupby("note_id", sort=True)["diff"].mean())
        row.update({"n_notes": int(d["note_id"].nunique()), "E_median": float(np.median(E)),
                    "E_share_above": float(big.mean()), "D_named_median": float(np.median(named)),
                    "D_control_median": _median(control), "n_control_unmatched": int(np.isnan(control).sum()),
                    "share_named": _median(share_named), "share_control": _median(share_control),
                    "reference_minus_clean_median": float(np.median(np.abs(d["reference"] - d["clean"])))})
        if len(diffs):
            t = difference_tests(diffs.to_numpy(), seed=seed)
            row.update({"named_minus_control": t.mean_diff, "ci_low": t.ci_low, "ci_high": t.ci_high,
                        "notes_higher": t.n_higher, "notes_lower": t.n_lower, "sign_p": t.sign_p})
        out.append(row)
    cols = ["head", "key_set", "n_events", "n_notes", "E_median", "E_share_above", "D_named_median",
            "D_control_median", "n_control_unmatched", "share_named", "share_control", "named_minus_control",
            "ci_low", "ci_high", "notes_higher", "notes_lower", "sign_p", "reference_minus_clean_median"]
    return pd.DataFrame(out).reindex(columns=cols)


def _median(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else math.nan


__all__ = ["KeyBlockConfig", "run_key_block", "parse_heads", "chosen_heads", "block_note", "key_block_table"]
