"""The GOLD arm on TRL's GOLD trainer, across tokenizers: the teacher's traces capped as the
paper's run did, the completion-window logits giving upstream's loss, the platform's data order,
and a run killed after a checkpoint that resumes to the same weights bit for bit."""

from __future__ import annotations

import pytest
import torch

from mistill.distill.gold import (capped_completion, completion_window_start, gold_args, train_gold,
                                  windowed_trainer_class)
from mistill.distill.trainer import RecipeConfig
from mistill.models.loading import embedded_tokenizer, tiny_model
from tok_fixtures import bpe_tokenizer
from trainer_fixtures import trained_and_resumed

EXAMPLES = [("Code this note. Patient with chronic kidney disease.\n",
             "<think>CKD, unspecified: N18.9.</think>\n[\"N18.9\"]"),
            ("Code this short note. Hypertension.\n", "<think>Essential hypertension: I10.</think>\n[\"I10\"]"),
            ("Code the note: pneumonia, organism unspecified, and type 2 diabetes.\n",
             "<think>J18.9 for the pneumonia; E11.9 for the diabetes.</think>\n[\"J18.9\", \"E11.9\"]")]
RECIPE = RecipeConfig(seed=3, precision="bf16", epochs=2, lr=1e-3, grad_accum=2)


def _pair(dtype=torch.bfloat16):
    """A Qwen3 student with the embedded (SmolLM2) tokenizer and a Llama teacher with a byte-level
    BPE tokenizer of its own: different vocabularies, as SmolLM3-3B against Qwen3-14B."""
    _, teacher_tok = bpe_tokenizer([p + c for p, c in EXAMPLES] * 10, vocab_size=400, all_bytes=True)
    student = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    teacher = tiny_model("llama", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=2, tokenizer=teacher_tok)
    assert student.tokenizer.get_vocab() != teacher_tok.get_vocab()
    return student.model.to(dtype), student.tokenizer, teacher.model, teacher_tok


def test_the_teachers_trace_is_cut_after_cap_tokens():
    tok = embedded_tokenizer()
    prompt, trace = "Code it.\n", "<think>N18.9 and I10</think> [\"N18.9\"]"
    full = prompt + trace
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    n_trace = sum(s >= len(prompt) for s, _ in offsets)
    assert capped_completion(full, offsets, len(prompt), n_trace) == (trace, False)
    text, cut = capped_completion(full, offsets, len(prompt), 4)
    assert cut and trace.startswith(text) and len(text) < len(trace)
    assert sum(len(prompt) <= s < len(prompt) + len(text) for s, _ in offsets) == 4


def test_the_completion_window_starts_one_before_the_earliest_completion_token():
    labels = torch.full((2, 9), -100)
    labels[0, 5:] = 1
    labels[1, 3:7] = 1
    assert completion_window_start(labels) == 2
    labels[1, 0:] = 1
    assert completion_window_start(labels) == 0
    assert completion_window_start(torch.full((1, 4), -100)) == 3


def test_windowed_logits_give_upstreams_loss_in_the_platforms_order(tmp_path):
    """Off-policy batches (fraction 0): the loss over the completion window equals upstream's
    full-sequence ULD loss, hybrid and plain; the sampler keeps the dataset's order."""
    from datasets import Dataset

    student, tok, teacher, teacher_tok = _pair(torch.float32)
    teacher_tok.pad_token = teacher_tok.eos_token
    teacher_tok.save_pretrained(tmp_path / "tt")
    dataset = Dataset.from_dict({"prompt": [p for p, _ in EXAMPLES] * 2, "completion": [c for _, c in EXAMPLES] * 2})
    for hybrid in (True, False):
        args = gold_args(RECIPE.replace(epochs=1, grad_accum=3), tmp_path / f"out{hybrid}", n_examples=6,
                         rollout_cap=8, on_policy_fraction=0.0, beta=0.5, hybrid=hybrid,
                         teacher_tokenizer_dir=tmp_path / "tt", device="cpu")
        trainer = windowed_trainer_class()(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                                           processing_class=tok)
        assert list(trainer._get_train_sampler()) == [0, 1, 2] * 3 + [3, 4, 5] * 3
        batch = next(iter(trainer.get_train_dataloader()))
        assert batch["original_completion_text"] == [c + tok.eos_token for _, c in EXAMPLES]
        assert completion_window_start(batch["labels"]) > 0  # the window leaves positions out
        losses = []
        for window in (True, False):
            trainer.completion_window = window
            with torch.no_grad():
                losses.append(float(trainer.compute_loss(trainer.model, batch)))
        assert losses[0] > 0 and losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7), hybrid


def _train(out, *, resume=False, callbacks=(), probe=None):
    student, tok, teacher, teacher_tok = _pair()
    logs = []
    steps = train_gold(student, teacher, tok, teacher_tok, EXAMPLES, RECIPE, out, rollout_cap=6,
                       on_policy_fraction=0.5, beta=0.5, hybrid=True, device="cpu",
                       log=lambda m, s: logs.append((s, m)), after_step=probe, resume=resume, callbacks=callbacks)
    return student, logs, steps


def test_gold_trains_across_tokenizers_logs_and_resumes_bit_for_bit(tmp_path):
    per_step = trained_and_resumed(_train, tmp_path, RECIPE, 4)
    for m in per_step.values():
        assert {"loss", "grad_norm", "matched_loss", "unmatched_loss"} <= set(m)
    # both halves ran: the student's rollouts and the teacher's traces
    assert any("on_policy_loss" in m for m in per_step.values())
    assert any("off_policy_loss" in m for m in per_step.values())


def test_gold_rollouts_through_trls_colocated_engine_from_the_students_directory(tmp_path, monkeypatch):
    """A student loaded from a directory the rollout engine can build from (config, weights and
    the padded tokenizer): TRL's colocated engine is built from that directory, with the engine's
    share of the GPU and a window of the longest prompt plus the rollout cap, the student's
    weights are copied into it before each on-policy step's rollouts, and it is closed after."""
    import trl.experimental.gold.gold_trainer as upstream
    from test_onpolicy import stand_in_engine
    from transformers import AutoModelForCausalLM

    from mistill.distill.gold import padded_tokenizer
    from mistill.distill.onpolicy import LAUNCH_VARIABLES, RolloutEngine, save_rollout_model

    built: list = []
    monkeypatch.setattr(upstream, "VLLMGeneration", stand_in_engine(built))
    monkeypatch.setattr(upstream, "is_vllm_available", lambda *args, **kwargs: True)
    for key in LAUNCH_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    student, tok, teacher, teacher_tok = _pair()
    directory = save_rollout_model(student, padded_tokenizer(tok), tmp_path / "student")
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    steps = train_gold(loaded, teacher, tok, teacher_tok, EXAMPLES, RECIPE.replace(max_steps=2), tmp_path / "out",
                       rollout_cap=6, on_policy_fraction=1.0, beta=0.5, hybrid=True, device="cpu",
                       log=lambda m, s: None, engine=RolloutEngine(gpu_memory=0.3))
    (engine,) = built
    assert engine.built_from == str(directory) and loaded.name_or_path == str(directory)
    longest = max(len(padded_tokenizer(tok)(text=p)["input_ids"]) for p, _ in EXAMPLES)
    assert (engine.kwargs["mode"], engine.kwargs["gpu_memory_utilization"], engine.kwargs["max_model_length"]) == (
        "colocate", 0.3, longest + 6)
    assert steps == engine.syncs == 2 and engine.rollouts >= 2  # every micro-step on-policy
    assert not hasattr(engine, "llm")
