"""The LAS simulator (mistill.evaluation.las) and its stage ``las_simulator``: the per-note
arithmetic and its empty-set convention, the two input formats, deterministic fine-tuning of a
tiny random Qwen3, unparsable predictions, and the stage end to end on a real MLflow server
(artifacts-only loading, reuse, and a restricted corpus whose text never reaches the server)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from mistill.data.corpus import Corpus, Note
from mistill.data.synthetic import make_synthetic_corpus
from mistill.evaluation.las import (IGNORE_INDEX, Simulator, _ClosedList, _stopped_text, greedy_answers, TeacherExample, answer_target, encode_pair,
                                    fitted_answer, format_input, greedy_answer, format_note_only, format_with_rationale,
                                    las_per_note, set_f1, teacher_example, train_simulator)
from mistill.evaluation.parsing import CodeIndex
from mistill.models.loading import load_model, tiny_model
from mistill.stages.las import LasSimulatorConfig, load_simulator, run_las_simulator
from mistill.stages.prepare import PrepareConfig, run_prepare
from stage_fixtures import TINY, artifact_paths, leaks, n_runs, phrase_needles, tracked_texts, unique


@pytest.fixture(scope="module")
def synthetic():
    return make_synthetic_corpus(n_notes=6, seed=0)


def _short_examples(corpus: Corpus, n: int = 2) -> list[TeacherExample]:
    """Training notes with the teacher's rationale and answer, short enough for a fast test."""
    index = CodeIndex(list(corpus.inventory.codes))
    out = []
    for note in corpus.split("train").notes[:n]:
        ex = teacher_example(note.note_id, note.text, note.teacher_trace, index)
        out.append(TeacherExample(ex.note_id, ex.note_text, " ".join(ex.rationale.split()[:40]), ex.answer))
    return out


# ------------------------------------------------------------------------------ arithmetic
def test_set_f1_and_las_on_hand_built_sets():
    assert set_f1({"A", "B"}, {"A", "B"}) == 1.0
    assert set_f1({"A", "B"}, {"B", "C"}) == pytest.approx(0.5)  # 2*1 / (2+2)
    assert set_f1({"A"}, {"A", "B", "C"}) == pytest.approx(0.5)  # 2*1 / (1+3)
    assert set_f1({"X"}, {"A"}) == 0.0
    # the documented convention: two empty sets agree exactly; one empty set scores 0
    assert set_f1(set(), set()) == 1.0
    assert set_f1(set(), {"A"}) == 0.0 and set_f1({"A"}, set()) == 0.0

    teacher = {"A", "B", "C", "D"}
    assert las_per_note({"A", "B", "C", "D"}, {"A"}, teacher) == pytest.approx(1.0 - 0.4)
    assert las_per_note({"A"}, {"A", "B", "C", "D"}, teacher) == pytest.approx(-0.6)
    assert las_per_note({"A", "B"}, {"A", "B"}, teacher) == 0.0
    # the teacher answered nothing: an empty prediction with the rationale is worth +1
    assert las_per_note(set(), {"A"}, set()) == 1.0
    assert las_per_note({"A"}, set(), set()) == -1.0
    assert las_per_note(set(), set(), {"A"}) == 0.0


# ---------------------------------------------------------------------------- input formats
def test_input_formats_with_and_without_rationale_never_hold_the_answer(synthetic):
    tok = tiny_model().tokenizer
    ex = teacher_example(*(lambda n: (n.note_id, n.text, n.teacher_trace))(synthetic.notes[0]),
                         CodeIndex(list(synthetic.inventory.codes)))
    assert len(ex.answer) >= 3 and "</think>" not in ex.rationale and "<think>" not in ex.rationale
    answer_json = answer_target(ex.answer)
    assert json.loads(answer_json) == list(ex.answer)

    with_r = format_with_rationale(ex.note_text, ex.rationale, max_note_words=50)
    note_only = format_note_only(ex.note_text, max_note_words=50)
    assert "Reasoning:" in with_r and "Reasoning:" not in note_only
    assert ex.rationale.strip()[-60:] in with_r and ex.rationale.strip()[:60] not in note_only
    first_words = " ".join(ex.note_text.split()[:50])
    assert first_words in with_r and first_words in note_only
    assert note_only.split()[2:-4] == ex.note_text.split()[:50]  # cut after 50 words
    assert with_r.endswith("ICD-10-CM codes (JSON list):\n") and note_only.endswith("ICD-10-CM codes (JSON list):\n")
    assert format_input(ex.note_text, None, max_note_words=50) == note_only
    assert format_input(ex.note_text, "", max_note_words=50) != note_only  # empty rationale is still (a)
    for text in (with_r, note_only):
        assert answer_json not in text and "</think>" not in text

    a, b = encode_pair(ex, tok, max_answer_tokens=40, max_note_words=50, max_positions=None)
    answer_ids, kept = fitted_answer(ex.answer, tok, 40)
    assert 0 < kept < len(ex.answer) and len(answer_ids) <= 40  # cut to the cap, closed list
    assert json.loads(tok.decode(answer_ids, skip_special_tokens=True)) == list(ex.answer[:kept])
    for enc, prompt in ((a, with_r), (b, note_only)):
        n_prompt = int((enc.labels == IGNORE_INDEX).sum())
        assert enc.input_ids[n_prompt:].tolist() == answer_ids  # labels on the answer only
        assert enc.labels[n_prompt:].tolist() == answer_ids
        assert tok.decode(enc.input_ids[:n_prompt].tolist()) == prompt
    assert a.input_ids.numel() > b.input_ids.numel()


# --------------------------------------------------------------------------------- training
def _train_once(examples, seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    lm = load_model(TINY)
    pairs = [encode_pair(ex, lm.tokenizer, max_answer_tokens=24, max_note_words=24, max_positions=None)
             for ex in examples]
    losses = train_simulator(lm.model, pairs, max_steps=8, lr=3e-3, seed=seed, progress=False)
    assert not any(p.requires_grad for p in lm.model.parameters()) and not lm.model.training
    return losses, {k: v.clone() for k, v in lm.model.state_dict().items()}


def test_training_lowers_the_loss_deterministically(synthetic):
    examples = _short_examples(synthetic)
    losses, weights = _train_once(examples, seed=0)
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0
    losses2, weights2 = _train_once(examples, seed=0)
    assert losses2 == losses
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
    untrained = load_model(TINY).model.state_dict()
    assert not all(torch.equal(weights[k], untrained[k]) for k in weights)


def test_unparsable_prediction_counts_as_empty(synthetic):
    lm = load_model(TINY)
    codes = list(synthetic.inventory.codes)
    sim = Simulator(lm.model, lm.tokenizer, codes, max_answer_tokens=6, max_note_words=20)
    assert sim.parse("the codes are probably cardiac") == [] and sim.n_unparsable == 1
    assert sim.parse(f'["{codes[3]}", "Q99.XXX", "{codes[3]}", 7]') == [codes[3]]  # inventory, de-duplicated
    assert sim.parse("[]") == [] and sim.n_unparsable == 1 and sim.n_predictions == 3
    # an untrained model writes no closed list in 6 tokens: an empty prediction, counted
    raw = sim.generate(synthetic.notes[0].text, "some reasoning")
    got = sim.predict(synthetic.notes[0].text, "some reasoning")
    assert "]" not in raw and got == [] and sim.n_unparsable == 2 and sim.n_predictions == 4
    assert sim.las(synthetic.notes[0].text, "r", [codes[0]]) == 0.0  # both empty: 0 - 0
    assert sim.n_unparsable == 4


def test_greedy_decoding_with_the_cache_matches_full_recomputation(synthetic):
    lm = load_model(TINY)
    prompt = format_note_only(synthetic.notes[0].text, max_note_words=30)
    got = greedy_answer(lm.model, lm.tokenizer, prompt, max_new_tokens=12)
    ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(12):
            nxt = int(lm.model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].argmax())
            out.append(nxt)
    assert got == lm.tokenizer.decode(out, skip_special_tokens=True) and len(out) == 12


def test_batched_greedy_answers_match_one_prompt_at_a_time(synthetic):
    lm = load_model(TINY)
    prompts = [format_note_only(n.text, max_note_words=w) for n, w in zip(synthetic.notes[:3], (30, 8, 19))]
    prompts.append(format_with_rationale(synthetic.notes[3].text, "a short rationale", max_note_words=12))
    one = [greedy_answer(lm.model, lm.tokenizer, p, max_new_tokens=10) for p in prompts]
    assert len({len(lm.tokenizer(p)["input_ids"]) for p in prompts}) == 4  # every row padded differently
    for batch in (1, 3, 4):
        assert greedy_answers(lm.model, lm.tokenizer, prompts, max_new_tokens=10, batch_size=batch) == one
    with pytest.raises(ValueError, match="batch_size"):
        greedy_answers(lm.model, lm.tokenizer, prompts, max_new_tokens=10, batch_size=0)


def test_the_batched_stop_rule_is_the_single_prompts(synthetic):
    lm = load_model(TINY)
    tok = lm.tokenizer
    listed = tok('["A01.1", "B02"] and then more text', add_special_tokens=False)["input_ids"]
    assert _stopped_text(tok, listed) == '["A01.1", "B02"]'
    assert _stopped_text(tok, listed[:3] + [tok.eos_token_id] + listed[3:]) == tok.decode(listed[:3])
    open_only = tok('["A01.1", "B02" and on', add_special_tokens=False)["input_ids"]
    assert _stopped_text(tok, open_only) == tok.decode(open_only)
    # the stopping criterion marks a row done once its new tokens close a list, not before
    width = 2
    cut = next(k for k in range(1, len(listed) + 1) if tok.decode(listed[:k]).endswith("]"))
    rows = torch.tensor([[7, 8] + listed[:cut], [7, 8] + open_only[:cut]])
    assert _ClosedList(tok, width)(rows, None).tolist() == [True, False]
    assert _ClosedList(tok, width)(rows[:, :cut + 1], None).tolist() == [False, False]


def test_simulator_las_many_matches_las_note_by_note(synthetic):
    lm = load_model(TINY)
    codes = list(synthetic.inventory.codes)
    items = [(n.text, f"reasoning {k}", [codes[k]]) for k, n in enumerate(synthetic.notes[:3])]
    one = Simulator(lm.model, lm.tokenizer, codes, max_answer_tokens=6, max_note_words=20, checkpoint_key="k1")
    many = Simulator(lm.model, lm.tokenizer, codes, max_answer_tokens=6, max_note_words=20, checkpoint_key="k2",
                     batch_size=2)
    expected = [one.las(*item) for item in items]
    assert many.las_many(items) == expected
    assert many.n_predictions == one.n_predictions == 6 and many.n_unparsable == one.n_unparsable
    texts = many.generate_many([(t, r) for t, r, _ in items] + [(t, None) for t, _, _ in items])
    assert texts == [one.generate(t, r) for t, r, _ in items] + [one.generate(t, None) for t, _, _ in items]


# ------------------------------------------------------------------------------- the stage
SMALL_SIM = dict(model=TINY, max_steps=6, lr=3e-3, max_answer_tokens=24, max_note_words=48)


def test_stage_end_to_end_artifacts_reload_and_reuse(tracking_uri, tmp_path, monkeypatch, pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    name = unique("las")
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=name, n_notes=6, model=TINY))
    cfg = LasSimulatorConfig(prepare_run=prep, **SMALL_SIM)
    run_id = run_las_simulator(cfg)
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.stage"] == "las_simulator"
    assert run.data.tags["mistill.input.prepare"] == prep
    history = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(6))
    m = run.data.metrics
    assert m["train_loss_last"] < m["train_loss_first"] and m["n_train_notes"] == 3
    assert m["val/n_notes"] == 2 and 0.0 <= m["val/unparsable_rate"] <= 1.0
    assert m["val/las_teacher_mean"] == pytest.approx(m["val/f1_with_rationale"] - m["val/f1_note_only"])
    arts = artifact_paths(client, run_id)
    assert {"config.json", "simulator/model.safetensors", "simulator/config.json",
            "simulator/simulator.json", "val_las.csv"} <= arts
    assert "simulator/inventory.json" not in arts
    assert "simulator/tokenizer.json" in arts  # synthetic text may be logged

    local = load_simulator(run_id)  # the work dir of this machine
    note = load_prepared_note(prep, "val")
    ref = local.generate(note.text, note.teacher_trace)

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "other-machine"))
    remote = load_simulator(run_id)  # from the logged artifacts alone
    assert (tmp_path / "other-machine" / "work" / run_id / "simulator" / "inventory.json").exists()
    assert remote.generate(note.text, note.teacher_trace) == ref
    assert remote.max_note_words == 48 and remote.max_answer_tokens == 24
    w_local, w_remote = local.model.state_dict(), remote.model.state_dict()
    assert all(torch.equal(w_local[k], w_remote[k]) for k in w_local)

    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    # sim(note) of a saved simulator is decoded once per process: a second load of the same
    # checkpoint answers it without a forward, and counts the prediction as made
    alone = local.predict(note.text, None)
    again = load_simulator(run_id)
    forwards = []
    again.model.register_forward_hook(lambda *a: forwards.append(1))
    assert again.predict(note.text, None) == alone and forwards == [] and again.n_predictions == 1
    assert again.predict(note.text, note.teacher_trace) is not None and forwards  # with a rationale: decoded
    fresh = Simulator(local.model, local.tokenizer, local.index, max_answer_tokens=local.max_answer_tokens,
                      max_note_words=local.max_note_words)  # no checkpoint key: nothing kept
    forwards.clear()
    fresh.model.register_forward_hook(lambda *a: forwards.append(1))
    assert fresh.predict(note.text, None) == alone and forwards

    before = n_runs(f"mistill/{name}")
    assert run_las_simulator(cfg) == run_id  # identical finished run reused
    assert n_runs(f"mistill/{name}") == before
    other = run_las_simulator(cfg.replace(seed=1))
    assert other != run_id and n_runs(f"mistill/{name}") == before + 1


def load_prepared_note(prepare_run: str, split: str) -> Note:
    from mistill.stages.common import load_prepared

    return load_prepared(prepare_run).corpus.split(split).notes[0]


CANARY_ID = "CANARY-las-90e1b7"
CANARY_SENTENCE = "a violet tugboat hummed nine lullabies under the granite viaduct at noon"


def _restricted_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """Four restricted notes (three train, one val) with the canary in their texts and traces."""
    inv = make_synthetic_corpus(n_notes=1, seed=0).inventory
    cats = [c for c in inv.categories() if len(inv.codes_in_category(c)) >= 2]
    notes = []
    for i in range(4):
        c1, c2 = inv.codes_in_category(cats[i])[0], inv.codes_in_category(cats[i + 9])[0]
        text = (f"Discharge summary {i} (planted test note).\nReference {CANARY_ID} on admission. "
                f"{CANARY_SENTENCE.capitalize()}.\nAdmitted, treated on the ward and improved.\n")
        trace = (f"<think>\nThe summary cites {CANARY_ID} and says {CANARY_SENTENCE}.\n"
                 f"The first finding fits {c1}; the second fits {c2}.\n</think>\n\n" + json.dumps([c1, c2]))
        notes.append(Note(note_id=f"rl-{i:03d}", patient_id=f"rlp-{i:03d}", split="train" if i < 3 else "val",
                          text=text, gold_codes=(c1, c2), teacher_trace=trace))
    path = Corpus(name="planted", privacy="restricted", notes=notes, inventory=inv).to_jsonl(tmp_path / "rl.jsonl")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(inv.codes) + "\n")
    return Path(path), codes


def test_restricted_corpus_text_never_reaches_the_server(tracking_uri, tmp_path, monkeypatch,
                                                        pinned_code_version):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    corpus_file, codes_file = _restricted_corpus(tmp_path)
    name = unique("las-restricted")
    prep = run_prepare(PrepareConfig(corpus=str(corpus_file), corpus_name=name, privacy="restricted",
                                     codes_file=str(codes_file), model=TINY))
    run_id = run_las_simulator(LasSimulatorConfig(prepare_run=prep, **SMALL_SIM))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.privacy"] == "restricted"
    assert run.data.metrics["val/n_notes"] == 1
    arts = artifact_paths(client, run_id)
    assert "simulator/model.safetensors" in arts and "val_las.csv" in arts
    assert not {"simulator/tokenizer.json", "simulator/tokenizer_config.json"} & arts  # nothing textual

    needles = phrase_needles(CANARY_ID, 3) + phrase_needles(CANARY_SENTENCE, 4) + [" 90e1b7 "]
    places = list(tracked_texts(client, f"mistill/{name}", tmp_path / "dl", stages=["las_simulator"]))
    assert f"{run_id} artifact simulator/simulator.json" in [w for w, _ in places]
    assert leaks(places, needles) == []
    # control: the same scan finds the canary in the local corpus file
    assert leaks([("corpus", corpus_file.read_text())], needles)

    shutil.rmtree(tmp_path / "root" / "work" / run_id)
    sim = load_simulator(run_id)  # artifacts + the prepare run's inventory; tokenizer from the base spec
    assert len(sim.index) == 120 and isinstance(sim.predict("a short note", None), list)
