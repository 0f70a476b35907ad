"""The generation probe during training (App. L.2): its metrics by hand, a scripted model that
answers with a category code is flagged while one that answers with the billable code is not,
the probe notes decoded together as each alone, and probing between optimizer steps leaves
training bit for bit as it was. And the train stage's other sampler, DistiLLM-2's dispreferred
generations: batched in chunks, resumed note by note."""

from __future__ import annotations

import pytest
import torch

from mistill.distill.trainer import RecipeConfig, Trainer, prepare_student
from mistill.evaluation.generation import DecodingConfig, Generation, generate_hf
from mistill.evaluation.parsing import CodeIndex
from mistill.evaluation.probe import (PROBE_METRICS, GenerationProbe, ProbeNote, category_entries,
                                      inventory_categories, probe_metrics)
from mistill.models.loading import tiny_model

CODES = ["N18.9", "N18.30", "E11.9", "I10"]
PROMPT = "Code this note:"


def _gen(text: str, *, capped: bool = False, n_tokens: int = 10) -> Generation:
    return Generation(text=text, token_ids=[], n_tokens=n_tokens, capped=capped, seed=0, decoding={})


def test_categories_are_the_strict_prefixes_of_inventory_codes():
    cats = inventory_categories(CODES)
    assert {"N18", "N183", "E11"} <= cats
    assert not {"N189", "I10", "E119", "N1"} & cats  # codes themselves, and too short
    index = CodeIndex(CODES)
    assert category_entries('<think>x</think>["N18", "n18.3", "N18.9", "Z99", 4]', index, cats) == (2, 4)
    assert category_entries('<think>x ["N18"]', index, cats) == (0, 0)  # reasoning never closed


def test_probe_metrics_by_hand():
    index, cats = CodeIndex(CODES), inventory_categories(CODES)
    gold = [["N18.9", "E11.9"], ["I10"], ["E11.9"], ["N18.30"]]
    gens = [_gen('<think>a</think>["N18.9", "E11"]'),   # one hit, one category entry
            _gen('<think>b</think>["I10"]'),             # one hit
            _gen("<think>c", capped=True, n_tokens=30),  # truncated at the cap
            _gen("<think>d</think> no list here")]       # valid, no parsed answer
    m = probe_metrics(gens, gold, index, cats, flag_share=0.5)
    assert set(m) == set(PROBE_METRICS)
    assert m["parse_rate"] == 0.5 and m["cap_rate"] == 0.25 and m["truncated_rate"] == 0.25
    assert m["category_rate"] == pytest.approx(1 / 3) and m["degenerate_rate"] == 0.25  # the capped one
    tp, fp, fn = 2, 0, 3
    assert m["micro_f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert m["mean_tokens"] == pytest.approx(15.0) and m["flagged"] == 0.0
    categories_only = [_gen('<think>a</think>["N18", "E11"]'), _gen('<think>b</think>["I10"]')]
    assert probe_metrics(categories_only, gold[:2], index, cats, 0.5)["flagged"] == 1.0  # 2 of 3 entries
    truncated = [_gen("<think>a", capped=True), _gen("<think>b"), _gen('<think>c</think>["I10"]')]
    flagged = probe_metrics(truncated, gold[:3], index, cats, 0.5)
    assert flagged["truncated_rate"] == pytest.approx(2 / 3) and flagged["flagged"] == 1.0
    with pytest.raises(ValueError):
        probe_metrics([], [], index, cats, 0.5)


def scripted_model(text: str, prompt: str):
    """A tiny Llama whose sampled continuation of ``prompt`` is ``text`` then end of sequence:
    its one layer writes nothing, the chain's tokens embed as one-hot directions, and its output
    layer maps each chain token to the next with a logit far above every other."""
    lm = tiny_model("llama", layers=1, heads=4, kv_heads=2, d_head=16, d_model=64, seed=0)
    tok, model = lm.tokenizer, lm.model
    prompt_last = tok(prompt, add_special_tokens=False)["input_ids"][-1]
    chain = [prompt_last] + tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1, "the scripted text repeats a token"
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for i, (a, b) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[a] = torch.nn.functional.one_hot(torch.tensor(i), 64).float()
            model.lm_head.weight[b, i] = 10.0
    return lm


@pytest.mark.parametrize("text,flagged", [('["N18"]', 1.0), ('["N18.9"]', 0.0)])
def test_a_scripted_model_answering_with_category_codes_is_flagged(text, flagged):
    """No think tags in the script (a closed reasoning block of length 0): a token may appear
    once in a bigram chain."""
    lm = scripted_model(text, PROMPT)
    decoding = DecodingConfig(max_new_tokens=64)
    assert generate_hf(lm, PROMPT, decoding, seed=1).text == text  # the script is what it says
    notes = [ProbeNote("n1", PROMPT, ("N18.9", "E11.9"), 1), ProbeNote("n2", PROMPT, ("N18.9",), 2)]
    m = GenerationProbe(lm, notes, CODES, decoding, flag_share=0.5)()
    assert m["flagged"] == flagged and m["truncated_rate"] == 0.0 and m["parse_rate"] == 1.0
    if flagged:
        assert m["category_rate"] == 1.0 and m["micro_f1"] == 0.0
    else:
        assert m["category_rate"] == 0.0 and m["micro_f1"] == pytest.approx(2 * 2 / (2 * 2 + 1))  # 2 hits, 1 miss


def test_probing_between_steps_leaves_training_as_it_was(tmp_path):
    """The probe decodes with the weights being trained (eval mode, no gradients, forked RNG):
    the weights and the loss trail are bit for bit those of a run without it."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 3000, (20,), generator=g) for _ in range(4)]

    def micro_step(model, idx):
        logits = model(data[idx][None]).logits[0, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits, data[idx][1:]) + torch.rand(()) * 1e-3
        return loss, {"ce": float(loss.detach())}

    def train(probe: bool):
        lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
        recipe = RecipeConfig(seed=3, precision="fp32", epochs=1, lr=1e-3, grad_accum=2)
        model = prepare_student(lm.model, recipe)
        steps, logs = [], []

        def after_step(step: int, last: bool) -> None:
            steps.append((step, last))
            if probe:
                generate_hf(lm, PROMPT, DecodingConfig(max_new_tokens=3), seed=step)
        Trainer(model, 4, recipe, micro_step, state_dir=tmp_path / str(probe), after_step=after_step,
                log=lambda m, s: logs.append(m["ce"])).train(progress=False)
        return model.state_dict(), logs, steps

    plain, probed = train(False), train(True)
    assert plain[2] == probed[2] == [(1, False), (2, True)]
    assert plain[1] == probed[1]
    for (name, a), b in zip(plain[0].items(), probed[0].values()):
        assert torch.equal(a, b), name


def test_the_probe_decodes_its_notes_together_as_each_alone():
    """The probe notes go through one batched call, each with its own seed: every note's
    completion is the one it gets alone, in the order given."""
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    decoding = DecodingConfig(max_new_tokens=5)
    notes = [ProbeNote("a", PROMPT, ("I10",), 11), ProbeNote("b", "Code the longer note, please:", ("I10",), 12),
             ProbeNote("c", PROMPT, ("I10",), 13)]
    probe = GenerationProbe(lm, notes, CODES, decoding, flag_share=0.5)
    together = probe.generate(notes)
    assert [g.seed for g in together] == [11, 12, 13]
    for note, gen in zip(notes, together):
        assert gen.token_ids == generate_hf(lm, note.prompt_text, decoding, note.seed).token_ids


class _Run:
    """The part of a train run that DistiLLM-2's dispreferred generations use: a work dir and a
    local enclave (where a restricted corpus's model text stays)."""

    def __init__(self, work_dir) -> None:
        self.work_dir = work_dir
        self.enclave_dir = work_dir / "enclave"
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


@pytest.mark.parametrize("allows_text", [True, False])
def test_dispreferred_generations_are_batched_and_resume_note_by_note(tmp_path, monkeypatch, allows_text):
    """Five notes in chunks of two through the HF backend, longest prompt first: a run that dies in
    its second chunk keeps the first chunk's notes, and the resumed run samples only the other
    three, ending with the generations of a run that was never interrupted (a synthetic or public
    corpus keeps them in the work dir, a restricted one in the run's local enclave)."""
    from types import SimpleNamespace

    import mistill.evaluation.backends as backends
    import mistill.stages.distill as distill
    from mistill.stages.distill import TrainStageConfig

    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    examples = [SimpleNamespace(student=SimpleNamespace(note=SimpleNamespace(note_id=f"n{i}"),
                                                        inp=SimpleNamespace(prompt=SimpleNamespace(
                                                            text=f"Code note {i}:" + " more" * i))))
                for i in range(5)]
    cfg = TrainStageConfig(dispreferred_max_new_tokens=4, seed=3)
    monkeypatch.setattr(distill, "DISPREFERRED_CHUNK", 2)
    sampled: list[list[str]] = []
    many = backends.generate_hf_many

    def counting(lm_, items, decoding, **kwargs):
        sampled.append([text for text, _ in items])
        if crash and len(sampled) == 2:
            raise RuntimeError("killed")
        return many(lm_, items, decoding, **kwargs)

    monkeypatch.setattr(backends, "generate_hf_many", counting)
    crash = False
    unbroken = distill._dispreferred(_Run(tmp_path / "unbroken"), lm, examples, cfg, allows_text, "hf", "cpu")
    assert [len(call) for call in sampled] == [2, 2, 1]
    sampled.clear()
    run, crash = _Run(tmp_path / "resumed"), True
    with pytest.raises(RuntimeError, match="killed"):
        distill._dispreferred(run, lm, examples, cfg, allows_text, "hf", "cpu")
    stage = (run.work_dir if allows_text else run.enclave_dir) / "dispreferred"
    assert sorted(p.stem for p in stage.glob("*.json")) == ["n3", "n4"]  # note i's prompt grows with i
    sampled.clear()
    crash = False
    resumed = distill._dispreferred(run, lm, examples, cfg, allows_text, "hf", "cpu")
    assert sampled == [[examples[i].student.inp.prompt.text for i in (2, 1)], [examples[0].student.inp.prompt.text]]
    assert resumed == unbroken and sorted(resumed) == list(range(5))
    assert all(1 <= len(ids) <= 4 for ids in resumed.values())
