"""The retrieved shortlist (App. A): fusion, sibling completion, the K rule, the linear head,
patient exclusion, the Note.shortlist field and its prompt, and the ``shortlist`` stage end to
end on a real MLflow server with the real all-MiniLM-L6-v2 encoder."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from stage_fixtures import TINY, unique

from mistill.data.corpus import Corpus
from mistill.data.inventory import Inventory, category
from mistill.data.shortlist import (
    Retriever,
    RetrieverSettings,
    baseline_rows,
    complete_with_siblings,
    fuse_scores,
    k_grid_for,
    macro_code_recall,
    micro_recall,
    pool_chunks,
    rank_desc,
    recall_sweep,
    select_k,
    split_training_notes,
    zero_shot_scores,
)
from mistill.data.synthetic import make_synthetic_corpus
from mistill.errors import MistillInputError
from mistill.models.encoder import EMBEDDED_ENCODER, chunk_words, load_encoder
from mistill.models.linear_head import LinearHead, train_linear_head
from mistill.stages.common import Prepared, load_prepared, note_input
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.shortlist import ShortlistConfig, run_shortlist, training_pool

# ----------------------------------------------------------------------------------- fusion


def test_rrf_fusion_by_hand() -> None:
    head = np.array([[3.0, 1.0, 2.0]])   # head ranks: c0=1, c2=2, c1=3
    zs = np.array([[0.1, 0.9, 0.5]])     # zero-shot ranks: c1=1, c2=2, c0=3
    fused = fuse_scores(head, zs, rule="rrf", weight=0.5, rrf_k=1.0)
    want = [0.5 / 2 + 0.5 / 4, 0.5 / 4 + 0.5 / 2, 0.5 / 3 + 0.5 / 3]
    np.testing.assert_allclose(fused[0], want)
    # c0 and c1 tie (first in one list, last in the other) and the tie goes to inventory order
    assert list(rank_desc(fused)[0]) == [0, 1, 2]
    # the weight moves the ranking toward one side; w=1 is the head alone, w=0 zero-shot alone
    assert list(rank_desc(fuse_scores(head, zs, weight=1.0))[0]) == list(rank_desc(head)[0])
    assert list(rank_desc(fuse_scores(head, zs, weight=0.0))[0]) == list(rank_desc(zs)[0])
    assert rank_desc(fuse_scores(head, zs, rule="rrf", weight=0.3, rrf_k=1.0))[0, 0] == 1


def test_zsum_fusion_by_hand() -> None:
    head = np.array([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    zs = np.array([[0.3, 0.2, 0.1], [0.0, 1.0, 0.5]])
    fused = fuse_scores(head, zs, rule="zsum", weight=0.25)
    def z(v):
        return (v - v.mean()) / v.std()

    np.testing.assert_allclose(fused[0], 0.25 * z(head[0]) + 0.75 * z(zs[0]))
    # a constant score row standardises to zeros: the other side alone decides
    np.testing.assert_allclose(fused[1], 0.75 * z(zs[1]))


def test_ranking_breaks_ties_by_inventory_order() -> None:
    assert list(rank_desc(np.array([[1.0, 2.0, 2.0, 1.0]]))[0]) == [1, 2, 0, 3]


def test_fusion_rejects_bad_input() -> None:
    with pytest.raises(MistillInputError, match="fusion"):
        fuse_scores(np.zeros((1, 3)), np.zeros((1, 3)), rule="max")
    with pytest.raises(MistillInputError, match="fusion_weight"):
        fuse_scores(np.zeros((1, 3)), np.zeros((1, 3)), weight=1.5)
    with pytest.raises(MistillInputError, match="shape"):
        fuse_scores(np.zeros((1, 3)), np.zeros((1, 4)))


def test_pooling_and_zero_shot_by_hand() -> None:
    chunks = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    assert pool_chunks(chunks).tolist() == pytest.approx([1.0, 1.0, 1.6 / 3, 1.8 / 3])
    codes = torch.tensor([[1.0, 0.0], [0.8, 0.6]])
    # code 0 matches chunk 0 exactly; code 1's best chunk is the third (0.48 + 0.48)
    assert zero_shot_scores(chunks, codes).tolist() == pytest.approx([1.0, 0.96])
    with pytest.raises(MistillInputError, match="chunk"):
        pool_chunks(torch.zeros(0, 2))


# ------------------------------------------------------------------------------- completion

@pytest.fixture(scope="module")
def small_inv() -> Inventory:
    return Inventory.billable(codes=["N18.1", "N18.2", "N18.9", "I10", "E11.9", "E11.65",
                                     "J45.20", "J45.909"])


def test_sibling_completion(small_inv) -> None:
    ranked = ["N18.9", "I10", "J45.909", "E11.9", "N18.1", "E11.65", "J45.20", "N18.2"]
    # K=2, siblings of the first 2: N18.1 then N18.2 in rank order (I10 has none)
    assert complete_with_siblings(ranked, 2, 200, small_inv) == ["N18.9", "I10", "N18.1", "N18.2"]
    # siblings_of=0: no completion; siblings_of=1 with K=3 leaves J45's sibling out
    assert complete_with_siblings(ranked, 3, 0, small_inv) == ranked[:3]
    assert complete_with_siblings(ranked, 3, 1, small_inv) == ["N18.9", "I10", "J45.909", "N18.1",
                                                               "N18.2"]
    # K=5: siblings of N18, J45 and E11 follow the top 5 in rank order, none repeated
    assert complete_with_siblings(ranked, 5, 200, small_inv) == ranked[:5] + ["E11.65", "J45.20",
                                                                             "N18.2"]
    # siblings missing from a partial ranking come from the inventory
    assert set(complete_with_siblings(["E11.9"], 1, 200, small_inv)) == {"E11.9", "E11.65"}
    with pytest.raises(MistillInputError, match="'k'"):
        complete_with_siblings(ranked, 0, 200, small_inv)


def test_recalls_by_hand() -> None:
    lists = [["A", "B"], ["A"], ["C"]]
    gold = [["A", "C"], ["A", "B"], ["C"]]
    # per code: A 2/2, B 0/1, C 1/2 -> macro 0.5; pooled 3 of 5
    assert macro_code_recall(lists, gold) == pytest.approx(0.5)
    assert micro_recall(lists, gold) == pytest.approx(0.6)
    assert math.isnan(macro_code_recall([], []))


def test_recall_sweep_rows(small_inv) -> None:
    ranked = [["N18.9", "I10", "J45.909", "E11.9", "N18.1", "E11.65", "J45.20", "N18.2"]]
    sweep = recall_sweep(ranked, [["N18.2", "E11.9"]], small_inv, [1, 4, 8], 200)
    assert sweep["recall"].tolist() == [0.0, 0.5, 1.0]
    # K=1 completed with N18.9's siblings finds N18.2; K=4 completed finds both
    assert sweep["recall_completed"].tolist() == [0.5, 1.0, 1.0]
    assert sweep["mean_len_completed"].tolist() == [3.0, 8.0, 8.0]
    assert k_grid_for(120) == (10, 20, 30, 40, 50, 60, 80, 100, 120)
    assert k_grid_for(50, (60, 5, 5)) == (5, 50)


# ----------------------------------------------------------------------------------- K rule

def _sweep(val, corpus, ks=(10, 20, 40, 80)) -> pd.DataFrame:
    return pd.DataFrame({"k": list(ks), "val_recall_completed": val,
                         "corpus_recall_completed": corpus})


def test_k_rule_smallest_k_on_both_sets() -> None:
    cols = ["val_recall_completed", "corpus_recall_completed"]
    d = select_k(_sweep([0.7, 0.88, 0.91, 0.95], [0.8, 0.92, 0.93, 0.97]), 0.9, cols)
    assert d["k"] == 40 and d["reached"] and d["binding"] == ["val_recall_completed"]
    # the corpus binds when it is the lower one
    d = select_k(_sweep([0.91, 0.92, 0.95, 0.99], [0.5, 0.89, 0.9, 0.99]), 0.9, cols)
    assert d["k"] == 40 and d["binding"] == ["corpus_recall_completed"]
    # rows out of order are sorted by K first
    d = select_k(_sweep([0.95, 0.91, 0.7, 0.8], [0.95, 0.95, 0.9, 0.9], ks=(80, 40, 10, 20)),
                 0.9, cols)
    assert d["k"] == 40
    # no K reaches the target: the largest K, flagged
    d = select_k(_sweep([0.1, 0.2, 0.3, 0.4], [0.9] * 4), 0.9, cols)
    assert d["k"] == 80 and not d["reached"]
    # an empty validation set (all NaN) does not bind and is reported
    d = select_k(_sweep([float("nan")] * 4, [0.5, 0.95, 0.96, 0.99]), 0.9, cols)
    assert d["k"] == 20 and d["skipped"] == ["val_recall_completed"]
    with pytest.raises(MistillInputError, match="target_recall"):
        select_k(_sweep([0.9] * 4, [0.9] * 4), 1.5, cols)


def test_baseline_rows_score_prefixes_and_the_whole_list() -> None:
    lists = [["A", "B", "C"], ["D", "E", "F", "G"]]
    gold = [["A", "C"], ["E"]]
    df = baseline_rows(lists, gold, [1, 2, 10])
    assert df["prediction"].tolist() == ["first 1", "first 2", "whole shortlist"]
    first1 = df.iloc[0]
    assert first1["micro_precision"] == pytest.approx(0.5)   # A right, D wrong
    assert first1["micro_recall"] == pytest.approx(1 / 3)
    whole = df.iloc[2]
    assert whole["micro_recall"] == pytest.approx(1.0) and whole["mean_n_pred"] == 3.5


# ------------------------------------------------------------------------------ linear head

def test_linear_head_learns_and_is_deterministic() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g)
    y = torch.stack([(x[:, 0] > 0), (x[:, 1] < 0), torch.zeros(40, dtype=torch.bool)], 1).float()
    a = train_linear_head(x, y, epochs=100, batch_size=16, seed=3)
    b = train_linear_head(x, y, epochs=100, batch_size=16, seed=3)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    logits = a.logits(x)
    assert ((logits[:, 0] > 0) == (x[:, 0] > 0)).float().mean() > 0.9
    assert ((logits[:, 1] > 0) == (x[:, 1] < 0)).float().mean() > 0.9
    assert (logits[:, 2] < -2).all()   # never positive in training: stays at the bottom
    c = train_linear_head(x, y, epochs=100, batch_size=16, seed=4)
    assert not torch.equal(a.weight, c.weight)   # the seed orders the mini-batches
    with pytest.raises(MistillInputError, match="features"):
        a.logits(torch.zeros(2, 5))
    with pytest.raises(MistillInputError, match="no training notes"):
        train_linear_head(torch.zeros(0, 6), torch.zeros(0, 3))


# ------------------------------------------------------------ the encoder and the retriever

@pytest.fixture(scope="module")
def encoder():
    return load_encoder(EMBEDDED_ENCODER)


@pytest.fixture(scope="module")
def tiny_corpora():
    """4 notes to shortlist and 8 training notes on a 30-code synthetic inventory."""
    corpus = make_synthetic_corpus(4, seed=0, inventory_size=30, n_codes_range=(3, 6))
    train = make_synthetic_corpus(8, seed=5, inventory=corpus.inventory, n_codes_range=(3, 6),
                                  splits={"train": 1.0})
    return corpus, train


def test_encoder_embeds_like_sentence_transformers(encoder) -> None:
    e = encoder.encode(["chronic kidney disease", "kidney failure", "fracture of the arm"])
    assert e.shape == (3, 384)
    assert torch.allclose(e.norm(dim=1), torch.ones(3), atol=1e-5)
    sims = e @ e.T
    assert sims[0, 1] > sims[0, 2] + 0.2   # related clinical phrases are nearer
    # a text's embedding does not depend on its batch companions or their order, up to float32
    # rounding: padding to another length changes the kernels' shapes; unit-norm components
    # agree to a few eps, 1e-5 is about 80 eps
    again = encoder.encode(["fracture of the arm", "kidney failure"], batch_size=1)
    assert torch.allclose(again[1], e[1], atol=1e-5)
    assert chunk_words("a b c d e", 2) == ["a b", "c d", "e"] and chunk_words("  ", 3) == []


def test_encoder_missing_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(MistillInputError, match="config.json missing"):
        load_encoder(str(tmp_path))
    with pytest.raises(MistillInputError, match="unknown embedded encoder"):
        load_encoder("embedded:gte-large")


def test_retriever_is_deterministic(encoder, tiny_corpora) -> None:
    corpus, train = tiny_corpora
    settings = RetrieverSettings(chunk_words=64, epochs=30)
    runs = []
    for _ in range(2):
        r = Retriever(encoder, corpus.inventory, settings)
        r.fit(train.notes)
        runs.append((r.rank(corpus.notes), r.head.weight.clone()))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])
    assert all(sorted(r) == sorted(corpus.inventory.codes) for r in runs[0][0])
    # a note's ranking depends on the note alone, not on the notes read with it
    assert r.rank([corpus.notes[2]])[0] == runs[0][0][2]


@pytest.fixture(scope="module")
def fitted(encoder, tiny_corpora) -> Retriever:
    corpus, train = tiny_corpora
    r = Retriever(encoder, corpus.inventory, RetrieverSettings(chunk_words=64, epochs=30))
    r.fit(train.notes)
    return r


def test_retriever_ranks_a_note_alone_as_in_any_batch(fitted, tiny_corpora) -> None:
    """Batch-invariant by design: every score row is a function of its note alone, computed by
    the same arithmetic for any batch size and position, so rows are compared bit for bit."""
    corpus, train = tiny_corpora
    codes = corpus.inventory.codes
    notes = list(corpus.notes) + list(train.notes[:4])
    alone = [[m[0] for m in fitted.scores([n])] for n in notes]
    batches = [list(range(8))[::-1], [3, 0], [5, 1, 6], [2, 7, 4, 0, 6]]
    batches += [[(i + s) % 8 for i in range(3)] for s in range(8)]  # every note at every slot of 3
    for idx in batches:
        head, zs, fused = fitted.scores([notes[i] for i in idx])
        for pos, i in enumerate(idx):
            a_head, a_zs, a_fused = alone[i]
            assert np.array_equal(head[pos], a_head), (idx, pos)
            assert np.array_equal(zs[pos], a_zs) and np.array_equal(fused[pos], a_fused), (idx, pos)
            # the other fusion rule is row-wise too
            assert np.array_equal(fuse_scores(head, zs, rule="zsum")[pos],
                                  fuse_scores(a_head, a_zs, rule="zsum")[0]), (idx, pos)
    # the rankings themselves: the whole set in one call against each note alone
    for ranking, (_, _, a_fused) in zip(fitted.rank(notes), alone):
        assert ranking == [codes[j] for j in rank_desc(a_fused[None])[0]]


def test_exact_ties_rank_in_inventory_order_alone_and_batched(encoder, tiny_corpora) -> None:
    """Codes with identical head weights score exactly alike wherever they sit in the inventory
    (the last code included, where a matrix kernel's edge tile sums in another order) and rank in
    inventory order; the head alone (fusion weight 1) decides the ranking."""
    corpus, _ = tiny_corpora
    inv = corpus.inventory
    r = Retriever(encoder, inv, RetrieverSettings(chunk_words=64, fusion_weight=1.0))
    n_feat = 2 * encoder.dim
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(len(inv), n_feat, generator=g) * 0.05
    tied = [0, 3, 7, 15, len(inv) - 1]
    weight[tied] = weight[3].clone()
    bias = torch.randn(len(inv), generator=g)
    bias[tied] = bias[3].clone()
    r.head = LinearHead(weight=weight, bias=bias, mean=torch.zeros(n_feat), scale=torch.ones(n_feat))
    tied_codes = [inv.codes[j] for j in tied]
    notes = list(corpus.notes)
    x, _ = r.features(notes, zero_shot=False)
    for n in range(1, len(notes) + 1):
        logits = r.head.logits(x[:n])
        assert (logits[:, tied] == logits[:, [0]]).all()
    alone = [r.rank([n])[0] for n in notes]
    for batch in (notes, notes[::-1], notes[1:3]):
        for note, ranking in zip(batch, r.rank(batch)):
            assert ranking == alone[notes.index(note)]
    for ranking in alone:
        at = [ranking.index(c) for c in tied_codes]
        assert at == sorted(at)                      # inventory order among the tied codes
        assert at == list(range(at[0], at[0] + len(at)))   # and nothing between them


def test_excluded_patients_never_reach_the_head(encoder, tiny_corpora) -> None:
    corpus, train = tiny_corpora
    # a training pool holding two of the evaluated corpus's own patients
    leaked = [replace(corpus.notes[0], note_id="leak-0"), replace(corpus.notes[1], note_id="leak-1")]
    pool = list(train.notes) + leaked
    excluded = {n.patient_id for n in corpus.notes}
    kept, dropped = split_training_notes(pool, excluded)
    assert {n.note_id for n in dropped} == {"leak-0", "leak-1"}
    assert not {n.patient_id for n in kept} & excluded and len(kept) == len(train)
    r = Retriever(encoder, corpus.inventory, RetrieverSettings(epochs=5))
    with pytest.raises(MistillInputError, match="excluded patient") as err:
        r.fit(pool, excluded)
    assert err.value.note == "leak-0"
    r.fit(kept, excluded)
    assert set(r.train_note_ids) == {n.note_id for n in train.notes}


def test_training_pool_needs_a_corpus_for_real_data(tiny_corpora, tmp_path) -> None:
    corpus, _ = tiny_corpora
    restricted = Corpus(name="r", privacy="restricted", notes=corpus.notes, inventory=corpus.inventory)
    prepared = Prepared(corpus=restricted, inventory=corpus.inventory, data_dir=tmp_path, run_id="x")
    with pytest.raises(MistillInputError, match="train_prepare_run"):
        training_pool(ShortlistConfig(prepare_run="0" * 32), prepared)
    synthetic = Prepared(corpus=corpus, inventory=corpus.inventory, data_dir=tmp_path, run_id="x")
    pool = training_pool(ShortlistConfig(prepare_run="0" * 32, train_synthetic_notes=5, train_seed=9),
                         synthetic)
    assert len(pool) == 5 and {n.split for n in pool} == {"train"}
    assert not {n.patient_id for n in pool} & {n.patient_id for n in corpus.notes}


# ------------------------------------------------------------------ Note.shortlist, prompt

def test_note_shortlist_roundtrip_digest_and_prompt(tiny_corpora, tmp_path) -> None:
    from mistill.models.loading import embedded_tokenizer

    corpus, _ = tiny_corpora
    inv = corpus.inventory
    note = corpus.notes[0]
    short = tuple(inv.codes[:5])
    with_sl = Corpus(name="c", privacy="synthetic", inventory=inv,
                     notes=[replace(note, shortlist=short)] + corpus.notes[1:])
    plain = Corpus(name="c", privacy="synthetic", inventory=inv, notes=corpus.notes)
    assert with_sl.digest != plain.digest
    path = with_sl.to_jsonl(tmp_path / "c.jsonl")
    back = Corpus.from_jsonl(path, name="c", privacy="synthetic", inventory=inv)
    assert back.notes[0].shortlist == short and back.notes[1].shortlist is None
    assert back.digest == with_sl.digest
    # the prompt lists exactly the shortlist, in its order; explicit candidates still win
    tok = embedded_tokenizer()
    ni = note_input(back.notes[0], inv, tok)
    assert ni.prompt.codes == short and set(ni.prompt.line_spans) == set(short)
    lines = ni.prompt.part("lines").split("\n")
    assert [ln.split(" ", 1)[0] for ln in lines] == list(short)
    assert note_input(back.notes[0], inv, tok, candidates=inv.codes[5:7]).prompt.codes == inv.codes[5:7]
    assert note_input(back.notes[1], inv, tok).prompt.codes == inv.codes


@pytest.mark.parametrize("value, match", [
    ("I10", "must be a list"), ([], "empty shortlist"), (["ZZZ.9"], "not in the inventory"),
    ([1], "not a string"), (None, None)])
def test_bad_shortlist_in_jsonl_names_file_line_note_field(tiny_corpora, tmp_path, value, match) -> None:
    corpus, _ = tiny_corpora
    row = corpus.notes[0].to_dict()
    if value is None:  # a code named twice (one dotted, one undotted)
        code = corpus.inventory.codes[0]
        value, match = [code, code.replace(".", "")], "twice"
    row["shortlist"] = value
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(MistillInputError, match=match) as err:
        Corpus.from_jsonl(path, inventory=corpus.inventory)
    e = err.value
    assert (e.file, e.line, e.note, e.field) == (str(path), 1, row["note_id"], "shortlist")


def test_bad_config_errors() -> None:
    for kwargs, fld in [({}, "prepare_run"), ({"prepare_run": "0" * 32, "fusion": "max"}, "fusion"),
                        ({"prepare_run": "0" * 32, "prompt_order": "alpha"}, "prompt_order"),
                        ({"prepare_run": "0" * 32, "target_recall": 0.0}, "target_recall"),
                        ({"prepare_run": "0" * 32, "k": -1}, "k")]:
        with pytest.raises(MistillInputError) as err:
            run_shortlist(ShortlistConfig(**kwargs))
        assert err.value.field == fld
    with pytest.raises(MistillInputError, match="unknown parameter"):
        ShortlistConfig.from_dict({"prepare_run": "x", "topk": 3})


# --------------------------------------------------------------------- the stage, end to end

@pytest.fixture(scope="module")
def staged(tracking_uri, tmp_path_factory, pinned_code_version):
    """prepare (4 notes, seed 0) and another corpus (8 notes of seed 0: patients synp0-000..007),
    then shortlist the first with the second's patients excluded. The synthetic training notes
    use the corpus's own seed, so their first 8 notes ARE those patients' notes: the exclusion
    must drop them."""
    root = tmp_path_factory.mktemp("shortlist-root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        mp.setenv("TQDM_DISABLE", "1")
        prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("sl"), n_notes=4,
                                         model=TINY))
        other = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("sl-other"),
                                          n_notes=8, model=TINY))
        cfg = ShortlistConfig(prepare_run=prep, train_synthetic_notes=20, train_seed=0,
                              exclude_prepare_runs=(other,), epochs=50, chunk_words=96,
                              baseline_ks=(5, 10))
        run_id = run_shortlist(cfg)
        again = run_shortlist(cfg)
        yield {"prep": prep, "other": other, "run": run_id, "again": again, "cfg": cfg,
               "root": root}


def _artifact(run_id: str, path: str) -> Path:
    return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path))


def test_stage_writes_a_prepared_corpus_with_shortlists(staged) -> None:
    client = MlflowClient()
    run = client.get_run(staged["run"])
    assert run.info.status == "FINISHED" and staged["again"] == staged["run"]  # reused
    tags = run.data.tags
    assert tags["mistill.stage"] == "shortlist" and tags["mistill.input.prepare"] == staged["prep"]
    src = load_prepared(staged["prep"])
    out = load_prepared(staged["run"])
    assert tags["mistill.corpus_digest"] == out.corpus.digest != src.corpus.digest
    assert out.corpus.name == src.corpus.name and out.inventory == src.inventory
    k = int(run.data.metrics["k"])
    ranked = json.loads(_artifact(staged["run"], "shortlists.json").read_text())
    for before, note in zip(src.corpus.notes, out.corpus.notes):
        assert replace(note, shortlist=None) == before       # nothing else changed
        sl = note.shortlist
        # prompt order is the shared inventory order; the set is the ranked list's
        assert list(sl) == sorted(sl, key=out.inventory.index)
        assert set(sl) == set(ranked[note.note_id])
        head, tail = ranked[note.note_id][:k], ranked[note.note_id][k:]
        assert len(head) == k
        assert {category(c) for c in tail} <= {category(c) for c in head[:200]}
        # the prompt a downstream stage builds lists exactly this shortlist
        from mistill.models.loading import embedded_tokenizer

        assert note_input(note, out.inventory, embedded_tokenizer()).prompt.codes == sl
    assert run.data.metrics["mean_shortlist_len"] == pytest.approx(
        np.mean([len(n.shortlist) for n in out.corpus.notes]))


def test_stage_k_rule_sweep_and_baseline(staged) -> None:
    run_id = staged["run"]
    sweep = pd.read_csv(_artifact(run_id, "recall_sweep.csv"))
    decision = json.loads(_artifact(run_id, "k_decision.json").read_text())
    assert sweep["k"].tolist() == list(k_grid_for(120))
    ok = sweep[(sweep["val_recall_completed"] >= 0.9) & (sweep["corpus_recall_completed"] >= 0.9)]
    assert decision["k"] == (int(ok["k"].min()) if len(ok) else int(sweep["k"].max()))
    assert decision["k_used"] == decision["k"] and decision["n_val_notes"] == 1
    # completion never lowers recall, and recall grows with K
    assert (sweep["corpus_recall_completed"] >= sweep["corpus_recall"] - 1e-12).all()
    assert sweep["corpus_recall"].is_monotonic_increasing
    assert sweep.iloc[-1]["corpus_recall"] == pytest.approx(1.0)   # K = the whole inventory
    # the baseline's whole-shortlist recall is the pooled recall of the test notes' lists
    base = pd.read_csv(_artifact(run_id, "retriever_baseline.csv"))
    assert base["prediction"].tolist() == ["first 5", "first 10", "whole shortlist"]
    assert set(base["notes"]) == {"test"}
    out = load_prepared(run_id)
    test = [n for n in out.corpus.notes if n.split == "test"]
    pooled = micro_recall([n.shortlist for n in test], [n.gold_codes for n in test])
    assert base.iloc[-1]["micro_recall"] == pytest.approx(pooled)
    assert {"micro_f1", "micro_precision", "p_at_8", "psp_at_8"} <= set(base.columns)


def test_stage_training_notes_exclude_every_evaluated_patient(staged) -> None:
    run = MlflowClient().get_run(staged["run"])
    train = pd.read_csv(_artifact(staged["run"], "retriever_train_notes.csv"), dtype=str)
    corpus_patients = {n.patient_id for n in load_prepared(staged["prep"]).corpus.notes}
    other_patients = {n.patient_id for n in load_prepared(staged["other"]).corpus.notes}
    assert not set(train["patient_id"]) & (corpus_patients | other_patients)
    # 20 generated notes of seed 0: the first 8 are the other corpus's patients (4 of them also
    # the shortlisted corpus's), so 8 are dropped and 12 train the head
    assert run.data.metrics["n_train_dropped"] == 8 and len(train) == 12
    assert run.data.metrics["n_excluded_patients"] == 8


def test_downstream_stage_takes_the_shortlist_run_as_prepare_run(staged, monkeypatch) -> None:
    from mistill.stages.characterize import EventsConfig, run_events

    monkeypatch.setenv("MISTILL_ROOT", str(staged["root"]))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    events = run_events(EventsConfig(prepare_run=staged["run"], model=TINY, max_notes=1, n_null=2))
    run = MlflowClient().get_run(events)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mistill.input.prepare"] == staged["run"]
    assert run.data.tags["mistill.corpus_digest"] == load_prepared(staged["run"]).corpus.digest


def test_stage_artifacts_suffice_without_the_local_data_dir(staged, monkeypatch) -> None:
    monkeypatch.setenv("MISTILL_ROOT", str(staged["root"]))
    tags = MlflowClient().get_run(staged["run"]).data.tags
    local = Path(tags["mistill.data_dir"])
    moved = local.with_name(local.name + ".moved")
    local.rename(moved)
    try:
        fetched = load_prepared(staged["run"])   # synthetic: downloaded from the run's artifacts
        assert fetched.data_dir != local and fetched.corpus.digest == tags["mistill.corpus_digest"]
        assert all(n.shortlist for n in fetched.corpus.notes)
    finally:
        moved.rename(local)


def test_stage_on_a_restricted_corpus_with_a_training_run(tracking_uri, tmp_path, monkeypatch,
                                                          pinned_code_version) -> None:
    """A restricted corpus: the head trains on another prepare run's train split (one of whose
    notes belongs to a patient of the shortlisted corpus and is dropped), and no note text or
    corpus file reaches the server."""
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    syn = make_synthetic_corpus(4, seed=0)
    train = make_synthetic_corpus(10, seed=3, inventory=syn.inventory, splits={"train": 0.8, "test": 0.2})
    leak = replace(syn.notes[0], note_id="leak", split="train")
    codes = tmp_path / "codes.txt"
    codes.write_text("\n".join(syn.inventory.codes) + "\n")
    runs = {}
    for name, notes in (("eval", syn.notes), ("train", [*train.notes, leak])):
        path = Corpus(name=name, privacy="restricted", notes=notes,
                      inventory=syn.inventory).to_jsonl(tmp_path / f"{name}.jsonl")
        runs[name] = run_prepare(PrepareConfig(corpus=str(path), corpus_name=unique(f"r-{name}"),
                                               privacy="restricted", codes_file=str(codes),
                                               model=TINY))
    run_id = run_shortlist(ShortlistConfig(prepare_run=runs["eval"], train_prepare_run=runs["train"],
                                           epochs=20, k=30))
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mistill.privacy"] == "restricted"
    assert run.data.tags["mistill.shortlist.train_prepare_run"] == runs["train"]
    arts = set()
    stack = [""]
    while stack:
        for f in client.list_artifacts(run_id, stack.pop() or None):
            (stack.append(f.path) if f.is_dir else arts.add(f.path))
    assert "data/inventory.json" in arts and not {"data/corpus.jsonl", "data/corpus_meta.json"} & arts
    trained = pd.read_csv(_artifact(run_id, "retriever_train_notes.csv"), dtype=str)
    assert "leak" not in set(trained["note_id"]) and len(trained) == 8   # the 8 train-split notes
    assert run.data.metrics["n_train_dropped"] == 1 and run.data.metrics["k"] == 30
    out = load_prepared(run_id)   # from the local data dir (restricted text stays here)
    assert out.corpus.privacy == "restricted"
    assert all(len(n.shortlist) >= 30 for n in out.corpus.notes)
