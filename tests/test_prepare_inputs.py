"""``prepare`` against a real MLflow server: each run loads its own prepared data (a folder per
run, its identity checked on load), files join the run's identity by content, and bad input
(parameters, bytes that are not UTF-8, note ids that cannot name a folder, notes longer than the
model takes) is refused before any run exists."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from mistill.config import file_digest
from mistill.data.corpus import Corpus
from mistill.data.inventory import Inventory
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.stages.common import CORPUS_META_FILE, INVENTORY_FILE, load_prepared
from mistill.stages.prepare import PrepareConfig, run_prepare
from stage_fixtures import TINY, unique

pytestmark = pytest.mark.usefixtures("pinned_code_version")


@pytest.fixture()
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    return tmp_path / "root"


def _jsonl_corpus(tmp_path: Path, n_notes: int = 3) -> tuple[Path, Path, Corpus]:
    """Synthetic notes written as a JSONL corpus, and a code file of their inventory."""
    syn = make_synthetic_corpus(n_notes=n_notes, seed=0)
    path = Path(Corpus(name="c", privacy="restricted", notes=syn.notes,
                       inventory=syn.inventory).to_jsonl(tmp_path / "corpus.jsonl"))
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    return path, codes, syn


def _runs_of_corpus(name: str) -> list:
    """Every run tagged with corpus ``name`` in any experiment, deleted ones included."""
    client = MlflowClient()
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(ids, filter_string=f"tags.`mistill.corpus` = '{name}'",
                              run_view_type=ViewType.ALL)


def _refused_without_a_run(cfg: PrepareConfig) -> MistillInputError:
    with pytest.raises(MistillInputError) as err:
        run_prepare(cfg)
    assert _runs_of_corpus(cfg.corpus_name) == []
    return err.value


# ------------------------------------------------------------------ each run, its own data
@pytest.mark.parametrize("field, first, second", [("order_seed", 0, 1),
                                                  ("remove_discharge_diagnosis", True, False)])
def test_runs_differing_in_one_input_each_load_their_own_data(tracking_uri, tmp_path, root, field,
                                                              first, second):
    path, codes, _ = _jsonl_corpus(tmp_path)
    base = PrepareConfig(corpus=str(path), corpus_name=unique("own"), codes_file=str(codes), model=TINY)
    cfgs = [base.replace(**{field: first}), base.replace(**{field: second})]
    ids = [run_prepare(c) for c in cfgs]
    assert ids[0] != ids[1]
    assert run_prepare(cfgs[0]) == ids[0]  # reused ...
    for cfg, run_id in zip(cfgs, ids):  # ... and each run still reads what it prepared
        prepared = load_prepared(run_id)
        want = Inventory.from_code_file(codes, order_seed=cfg.order_seed).codes
        assert prepared.inventory.codes == want, run_id
        assert prepared.remove_discharge_diagnosis is cfg.remove_discharge_diagnosis, run_id
    if field == "order_seed":
        assert load_prepared(ids[0]).inventory.codes != load_prepared(ids[1]).inventory.codes
    assert load_prepared(ids[0]).data_dir != load_prepared(ids[1]).data_dir


def test_a_changed_or_foreign_data_folder_is_refused(tracking_uri, tmp_path, root):
    path, codes, _ = _jsonl_corpus(tmp_path)
    base = PrepareConfig(corpus=str(path), corpus_name=unique("tamper"), codes_file=str(codes), model=TINY)
    a, b = run_prepare(base), run_prepare(base.replace(order_seed=1))
    folder_a, folder_b = load_prepared(a).data_dir, load_prepared(b).data_dir
    saved = {name: (folder_a / name).read_bytes() for name in (CORPUS_META_FILE, INVENTORY_FILE)}

    def restore() -> None:
        for name, data in saved.items():
            (folder_a / name).write_bytes(data)

    # run b's data in run a's folder (what a shared folder used to give)
    for name in saved:
        shutil.copyfile(folder_b / name, folder_a / name)
    with pytest.raises(MistillInputError) as err:
        load_prepared(a)
    assert err.value.field == "order_seed"
    assert a in str(err.value) and b in str(err.value) and str(folder_a) in str(err.value)
    restore()

    # a prompt flag edited in corpus_meta.json
    meta = json.loads(saved[CORPUS_META_FILE])
    (folder_a / CORPUS_META_FILE).write_text(json.dumps({**meta, "remove_discharge_diagnosis": False}))
    with pytest.raises(MistillInputError) as err:
        load_prepared(a)
    assert err.value.field == "remove_discharge_diagnosis" and a in str(err.value)
    restore()

    # a well-formed inventory.json in another order (its own digest consistent)
    other = Inventory.from_code_file(codes, order_seed=7)
    other.to_json(folder_a / INVENTORY_FILE)
    with pytest.raises(MistillInputError) as err:
        load_prepared(a)
    assert err.value.field == "inventory_sha256" and a in str(err.value)
    restore()

    assert load_prepared(a).inventory.codes == Inventory.from_code_file(codes, order_seed=0).codes


def test_a_corpus_edited_in_place_makes_a_new_run(tracking_uri, tmp_path, root):
    path, codes, syn = _jsonl_corpus(tmp_path)
    cfg = PrepareConfig(corpus=str(path), corpus_name=unique("edited"), codes_file=str(codes), model=TINY)
    first = run_prepare(cfg)
    old_text = syn.notes[0].text
    path.write_text(path.read_text().replace('"text": "', '"text": "Edited in place. ', 1))
    second = run_prepare(cfg)
    assert second != first
    assert load_prepared(second).corpus.notes[0].text == "Edited in place. " + old_text
    assert load_prepared(first).corpus.notes[0].text == old_text
    params = MlflowClient().get_run(second).data.params
    assert params["corpus_sha256"] == file_digest(path) and params["codes_file_sha256"] == file_digest(codes)


def test_content_digests_name_every_file_read(tmp_path):
    files = {name: tmp_path / name for name in ("c.jsonl", "t.feather", "codes.txt", "split.feather")}
    for i, p in enumerate(files.values()):
        p.write_text(f"content {i}\n")
    digest = {name: file_digest(p) for name, p in files.items()}
    jsonl = PrepareConfig(corpus=str(files["c.jsonl"]), codes_file=str(files["codes.txt"]))
    assert jsonl.content_digests() == {"corpus": digest["c.jsonl"], "codes_file": digest["codes.txt"]}
    mimic = PrepareConfig(corpus=f"mimic:{files['t.feather']}", split_file=str(files["split.feather"]))
    assert mimic.content_digests() == {"corpus": digest["t.feather"], "split_file": digest["split.feather"]}


def test_codes_per_note_bounds_the_synthetic_notes_gold_codes(tracking_uri, root):
    """The synthetic corpus a run prepares draws each note's gold codes from ``codes_per_note``
    (inclusive), and a narrower range is another run with its own notes."""
    base = PrepareConfig(corpus_name=unique("codes"), n_notes=6, inventory_size=40, model=TINY)
    narrow = base.replace(codes_per_note=(2, 3))
    counts = {cfg.codes_per_note: [len(n.gold_codes) for n in load_prepared(run_prepare(cfg)).corpus.notes]
              for cfg in (base, narrow)}
    assert all(2 <= c <= 3 for c in counts[(2, 3)]), counts
    assert max(counts[(5, 25)]) > 3, counts


# ---------------------------------------------------------------- refused before any run
@pytest.mark.parametrize("changes, field", [
    ({"n_notes": 0}, "n_notes"), ({"inventory_size": -3}, "inventory_size"), ({"select_n": -1}, "select_n"),
    ({"privacy": "secret"}, "privacy"), ({"select_split": "test"}, "select_split"),
    ({"corpus_name": "my corpus"}, "corpus_name"), ({"seed": -1}, "seed"),
    ({"codes_per_note": (6, 3)}, "codes_per_note"), ({"codes_per_note": (0, 3)}, "codes_per_note"),
    ({"codes_per_note": (3,)}, "codes_per_note"),
])
def test_bad_parameters_are_refused_before_a_run(tracking_uri, root, changes, field):
    kwargs = {"model": TINY, "corpus_name": unique("params"), "n_notes": 2, **changes}
    with pytest.raises(MistillInputError) as err:
        run_prepare(PrepareConfig(**kwargs))  # refused on construction or by run_prepare's validate()
    assert err.value.field == field
    assert _runs_of_corpus(kwargs["corpus_name"]) == []


def test_split_file_without_a_mimic_corpus_is_refused(tmp_path):
    path, codes, _ = _jsonl_corpus(tmp_path)
    with pytest.raises(MistillInputError) as err:
        PrepareConfig(corpus=str(path), split_file=str(codes)).validate()
    assert err.value.field == "split_file"


def test_non_utf8_corpus_is_refused_before_a_run(tracking_uri, tmp_path, root):
    path, codes, syn = _jsonl_corpus(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b"Discharge", b"D\xe9charge", 1)
    path.write_bytes(b"".join(lines))
    err = _refused_without_a_run(PrepareConfig(corpus=str(path), corpus_name=unique("latin1"),
                                               codes_file=str(codes), model=TINY))
    assert (err.file, err.line, err.note, err.field) == (str(path), 2, syn.notes[1].note_id, "text")
    assert f"file {path} line 2" in str(err)


def test_unsafe_note_id_is_refused_before_a_run(tracking_uri, tmp_path, root):
    path, codes, syn = _jsonl_corpus(tmp_path)
    path.write_text(path.read_text().replace(f'"{syn.notes[2].note_id}"', '"../../x"', 1))
    err = _refused_without_a_run(PrepareConfig(corpus=str(path), corpus_name=unique("unsafe"),
                                               codes_file=str(codes), model=TINY))
    assert (err.file, err.line, err.note, err.field) == (str(path), 3, "../../x", "note_id")


def _model_dir(tmp_path: Path, max_positions: int) -> Path:
    """A tiny Qwen3 saved as config + tokenizer only, taking ``max_positions`` positions."""
    from mistill.models.loading import tiny_model

    out = tmp_path / f"tiny-{max_positions}"
    lm = tiny_model("qwen3", max_pos=max_positions)
    lm.model.config.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    return out


def test_a_note_longer_than_the_model_is_refused_before_a_run(tracking_uri, tmp_path, root):
    from mistill.models.loading import embedded_tokenizer
    from mistill.stages.common import note_input

    path, codes, syn = _jsonl_corpus(tmp_path)
    long_note = dataclasses.replace(syn.notes[1], text=syn.notes[1].text + "\n" + "Stable overnight. " * 400)
    corpus = Corpus(name="c", privacy="restricted", inventory=syn.inventory,
                    notes=[syn.notes[0], long_note, syn.notes[2]])
    corpus.to_jsonl(path)
    tok = embedded_tokenizer()  # what tiny models tokenize with
    lengths = {n.note_id: note_input(n, syn.inventory, tok).input_ids.numel() for n in corpus.notes}
    limit = max(n for nid, n in lengths.items() if nid != long_note.note_id) + 1
    assert lengths[long_note.note_id] > limit
    cfg = PrepareConfig(corpus=str(path), corpus_name=unique("long"), codes_file=str(codes),
                        model=str(_model_dir(tmp_path, limit)))
    err = _refused_without_a_run(cfg)
    assert (err.note, err.file, err.line) == (long_note.note_id, str(path), 2)
    assert f"{limit} positions" in str(err) and f"file {path} line 2" in str(err)
    # the same corpus fits a model with exactly the positions its longest note needs
    roomy = _model_dir(tmp_path, lengths[long_note.note_id])
    run_id = run_prepare(cfg.replace(model=str(roomy)))
    assert MlflowClient().get_run(run_id).info.status == "FINISHED"
