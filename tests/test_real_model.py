"""The hook and patching invariants on the real SmolLM2-135M (the embedded default)."""

from __future__ import annotations

import pytest
import torch

from mistill.instrument.attribution import first_order
from mistill.instrument.hooks import HeadHook, Patch
from mistill.instrument.patching import Query, clean_read, knock_in
from mistill.instrument.runner import Runner
from mistill.models.loading import EMBEDDED_DEFAULT, load_model

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def lm():
    return load_model(EMBEDDED_DEFAULT)


def _ids(lm, text: str) -> torch.Tensor:
    return torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


TEXT = ("Under N, for the chronic kidney disease, I see N18.1, N18.9 and N18.30. N18.1 does not fit; "
        "set aside. So the code here is N18.9. For the type 2 diabetes, E11.9 or E11.65; E11.65 matches.")


def test_geometry_of_the_embedded_model(lm):
    g = lm.geometry
    assert (g.family, g.n_layers, g.n_heads, g.n_kv_heads, g.d_head, g.vocab) == ("llama", 30, 9, 3, 64, 49152)
    assert lm.tokenizer.tokenize(" N18.9") == ["ĠN", "1", "8", ".", "9"]


def test_noop_hook_bit_identical_and_layer_zeroing(lm):
    g = lm.geometry
    ids = _ids(lm, TEXT)[None]
    with torch.no_grad():
        plain = lm.model(ids).logits
        hook = HeadHook(g)
        try:
            assert torch.equal(lm.model(ids).logits, plain)
            mask = torch.zeros(1, g.n_layers, g.n_heads, dtype=torch.bool)
            mask[0, 12] = True
            with hook.patch(Patch(mask=mask, values=torch.zeros(g.n_layers, g.n_heads, g.d_head))):
                zeroed = lm.model(ids).logits
        finally:
            hook.remove()
        handle = g.layers[12].attn.register_forward_hook(
            lambda m, a, out: (torch.zeros_like(out[0]),) + tuple(out[1:]))
        try:
            ref = lm.model(ids).logits
        finally:
            handle.remove()
    torch.testing.assert_close(zeroed, ref, rtol=0, atol=1e-5)
    assert not torch.allclose(zeroed, plain)


def test_runner_knock_in_and_gradient_on_real_model(lm):
    g = lm.geometry
    clean_ids = _ids(lm, TEXT)
    donor_ids = _ids(lm, "Under I, for the hypertension, I10 is the code. For the pneumonia, J18.9 fits. " * 2)
    runner, hook = Runner(lm), HeadHook(g)
    with torch.no_grad():
        ref = lm.model(clean_ids[None]).logits[0]
    with hook.accumulate_mean() as acc:
        prefix, logits = runner.prefill(clean_ids, logits_at=torch.arange(clean_ids.numel()))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=2e-4)
    donor, _ = runner.prefill(donor_ids)
    letters = [lm.tokenizer.convert_tokens_to_ids(t) for t in ("ĠN", "ĠE", "ĠI", "ĠJ", "ĠK")]
    # the position before " N" in "N18.9": the chapter decision of a P1 event
    pos = int((clean_ids == letters[0]).nonzero()[-1]) - 1
    q = Query(position=pos, token_id=int(clean_ids[pos]), target_id=letters[0], competitor_ids=tuple(letters[1:]))
    prefix.crop(pos)
    clean = clean_read(runner, hook, prefix, q)
    fo = first_order(runner, hook, prefix, q, acc.mean)
    assert fo.margin == pytest.approx(clean.margin, abs=1e-4)
    qd = Query(position=20, token_id=q.token_id, target_id=q.target_id, competitor_ids=q.competitor_ids)
    donor.crop(20)
    corr = clean_read(runner, hook, donor, qd)
    m = knock_in(runner, hook, donor, qd, [list(range(g.n_total_heads)), []], clean.z, hidden_in=corr.hidden_in)
    assert m[0].item() == pytest.approx(clean.margin, abs=1e-4)
    assert m[1].item() == pytest.approx(corr.margin, abs=1e-4)


def test_cached_float_copy_matches_the_gguf(lm):
    from mistill.models.loading import _SMOLLM2_GGUF, embedded_model_dir
    from transformers import AutoModelForCausalLM

    gguf = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir()), gguf_file=_SMOLLM2_GGUF,
                                                dtype=torch.float32)
    ids = _ids(lm, TEXT)[None]
    with torch.no_grad():
        assert torch.equal(gguf(ids).logits, lm.model(ids).logits)
