"""Loading a model prints no per-load progress bar (a pipeline loads dozens of models), and leaves
transformers' own progress-bar setting as it found it."""

from __future__ import annotations

from transformers.utils import logging as hf_logging

from mistill.models.loading import load_model, load_tokenizer, tiny_model


def test_a_model_load_prints_no_weight_loading_bar(tmp_path, capfd):
    lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=8, d_model=32, seed=1)
    lm.model.save_pretrained(tmp_path)
    load_tokenizer("embedded:smollm2-135m").save_pretrained(tmp_path)
    capfd.readouterr()
    hf_logging.enable_progress_bar()
    loaded = load_model(str(tmp_path))
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err
    assert hf_logging.is_progress_bar_enabled()  # restored for the caller
    assert loaded.geometry.n_layers == 2
