"""The instrument's invariants on the GPU's path: bf16 weights, CUDA, the prefix runner's flash /
cuDNN attention and fused kernels, at the shapes the paper's runs take.

The suite proves these invariants in float32 on the CPU; the paper's runs never take that path.
This benchmark checks each one on a random-init real architecture, at a given note length, with
a threshold stated before the run (``THRESHOLDS``), and records the measured value and pass/fail:

- ``noop``: a forward with the head hook installed and nothing patched gives bit-identical
  logits to the plain forward (threshold: 0, exact);
- ``knockin_all``: knocking every head's clean output into the corrupted run (the clean token at
  another position of another note) gives back the clean margin; |difference| in nats, median and
  largest over the events;
- ``batched``: the batched mean-ablation patches against the same variants one forward each
  (``sequential_patch``); |difference| in nats, median and largest;
- ``attribution``: the first-order importance A_h = (mu_h - z_h) . dm/dz_h of the prefix runner,
  both graphs (intact and detached), against autograd through the plain transformers forward of
  the same tokens with an ``o_proj`` pre-hook on the event row (:func:`autograd_importance`):
  the largest relative L2 error and the smallest Pearson correlation over all heads, at a short
  note (the plain forward keeps every activation for its backward);
- ``bucketing``: read-side attention rows off the prefix, bucketed over a random bucket map, sum
  to one per head (largest |sum - 1|).

Usage (one GPU): ``python benchmarks/bench_invariants.py --model qwen3-14b --tokens 32768 --out raw.json``.
``--smoke``: a tiny Qwen3 on the CPU in float32, the same checks and thresholds (seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_instrument import ARCHS  # noqa: E402

from mistill.distill.buckets import bucketize  # noqa: E402
from mistill.instrument.attribution import first_order  # noqa: E402
from mistill.instrument.hooks import HeadHook  # noqa: E402
from mistill.instrument.patching import Query, clean_read, knock_in, mean_ablate, sequential_patch  # noqa: E402
from mistill.instrument.readside import prefix_attention_rows  # noqa: E402
from mistill.instrument.runner import Runner  # noqa: E402
from mistill.models.geometry import head_geometry  # noqa: E402
from mistill.models.loading import LoadedModel, tiny_model  # noqa: E402

THRESHOLDS: dict[str, float] = {
    "noop.max_abs_logit_diff": 0.0,
    "knockin_all.median_abs_nats": 0.05,
    "knockin_all.max_abs_nats": 0.25,
    "batched.median_abs_nats": 0.05,
    "batched.max_abs_nats": 0.25,
    "attribution.rel_l2": 0.1,
    "attribution.pearson_min": 0.99,
    "bucketing.max_abs_sum_error": 1e-3,
}
"""Each check's bound, fixed before the run. bf16 logits carry 8 bits of mantissa: a logit near
10 is resolved to about 0.06 nats, so a margin (a difference of two such values) can move by a
few hundredths between kernels that sum in another order; the largest bound allows a few such
steps. The CPU smoke mode in float32 sits far inside every bound."""


def build(name: str, max_pos: int, device: str) -> LoadedModel:
    if name == "smoke":
        return tiny_model("qwen3", layers=3, heads=4, kv_heads=2, d_head=16, d_model=64, seed=3)
    from transformers import AutoModelForCausalLM, Qwen3Config  # deferred: transformers is slow to import

    cfg = Qwen3Config(**ARCHS[name], max_position_embeddings=max_pos, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    return LoadedModel(model=model, tokenizer=None, geometry=head_geometry(model), spec=f"random:{name}")


def ids_of(n: int, seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 50_000), (n,), generator=g)


def query(ids: torch.Tensor, pos: int) -> Query:
    return Query(position=pos, token_id=int(ids[pos]), target_id=11, competitor_ids=(12, 13, 14, 15))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_noop(lm: LoadedModel, n: int, vocab: int) -> dict:
    ids = ids_of(n, 1, vocab)[None].to(lm.model.device)
    with torch.no_grad():
        plain = lm.model(ids).logits
        hook = HeadHook(lm.geometry)
        try:
            hooked = lm.model(ids).logits
        finally:
            hook.remove()
    return {"max_abs_logit_diff": float((plain.float() - hooked.float()).abs().max())}


def check_knockin_and_batched(lm: LoadedModel, runner: Runner, n: int, vocab: int, events: int) -> dict:
    g = lm.geometry
    hook = HeadHook(g)
    clean_ids, donor_ids = ids_of(n, 2, vocab), ids_of(n, 3, vocab)
    with hook.accumulate_mean() as acc:
        clean_prefix, _ = runner.prefill(clean_ids)
    donor_prefix, _ = runner.prefill(donor_ids)
    rng = np.random.default_rng(0)
    positions = sorted(rng.choice(np.arange(n // 4, n - 1), size=events, replace=False).tolist())
    all_heads = list(range(g.n_total_heads))
    knock, batched = [], []
    for i, pos in enumerate(positions):
        q_clean = query(clean_ids, pos)
        clean = clean_read(runner, hook, clean_prefix, q_clean)
        q_corr = Query(position=positions[(i + 1) % len(positions)], token_id=q_clean.token_id,
                       target_id=q_clean.target_id, competitor_ids=q_clean.competitor_ids)
        corr = clean_read(runner, hook, donor_prefix, q_corr)
        m = knock_in(runner, hook, donor_prefix, q_corr, [[], all_heads], clean.z, hidden_in=corr.hidden_in)
        knock.append(abs(float(m[1]) - clean.margin))
        variants = [[]] + [sorted(rng.choice(g.n_total_heads, size=k, replace=False).tolist())
                           for k in (1, 1, 8, 40) if k <= g.n_total_heads]
        fast = mean_ablate(runner, hook, clean_prefix, q_clean, variants, acc.mean, hidden_in=clean.hidden_in)
        slow = sequential_patch(runner, hook, clean_prefix, q_clean, variants, acc.mean)
        batched += (fast.float() - slow.float()).abs().tolist()
    return {"knockin_all": {"median_abs_nats": float(np.median(knock)), "max_abs_nats": float(np.max(knock)),
                            "events": len(knock)},
            "batched": {"median_abs_nats": float(np.median(batched)), "max_abs_nats": float(np.max(batched)),
                        "patches": len(batched)}}


def autograd_importance(lm: LoadedModel, ids: torch.Tensor, q: Query, mean: torch.Tensor, *,
                        detach: bool) -> torch.Tensor:
    """A_h by autograd through the plain transformers forward of ``ids[:pos+1]``, ``[layer*head]``.

    Intact graph (``detach=False``): each layer's ``o_proj`` input row at the event gets a zero
    perturbation leaf added, so dm/dz_h is the total derivative, through every later head.
    Detached (``detach=True``): the row is replaced by a leaf holding its values, which cuts the
    paths from one layer's heads through a later layer's attention output."""
    g = lm.geometry
    leaves: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def pre(module, args):
        x = args[0]
        row = x[:, -1:]
        values.append(row.detach().clone())
        if detach:
            leaf = row.detach().clone().requires_grad_(True)
            new_row = leaf
        else:
            leaf = torch.zeros_like(row, requires_grad=True)
            new_row = row + leaf
        leaves.append(leaf)
        return (torch.cat([x[:, :-1], new_row], dim=1),) + tuple(args[1:])

    handles = [layer.o_proj.register_forward_pre_hook(pre) for layer in g.layers]
    try:
        with torch.enable_grad():
            logits = lm.model(ids[: q.position + 1][None].to(lm.model.device)).logits[0, -1].float()
            comp = torch.tensor(q.competitor_ids, device=logits.device)
            margin = logits[q.target_id] - torch.logsumexp(logits[comp], dim=-1)
            grads = [gr.detach() for gr in torch.autograd.grad(margin, leaves)]
    finally:
        for h in handles:
            h.remove()
    z = torch.stack([v[0, 0].view(g.n_heads, g.d_head) for v in values]).float()
    dz = torch.stack([gr[0, 0].view(g.n_heads, g.d_head) for gr in grads]).float()
    return (-((mean.float().to(z.device) - z) * dz).sum(-1)).flatten().cpu()


def check_attribution(lm: LoadedModel, runner: Runner, n: int, vocab: int) -> dict:
    hook = HeadHook(lm.geometry)
    ids = ids_of(n, 4, vocab)
    with hook.accumulate_mean() as acc:
        prefix, _ = runner.prefill(ids)
    errs, corrs = [], []
    for pos in (n // 2, n - 2):
        q = query(ids, pos)
        for detach in (False, True):
            ours = first_order(runner, hook, prefix, q, acc.mean, detach=detach).importance.detach().float()
            ref = autograd_importance(lm, ids, q, acc.mean, detach=detach)
            errs.append(float((ours - ref).norm() / ref.norm().clamp_min(1e-12)))
            corrs.append(float(np.corrcoef(ours.numpy(), ref.numpy())[0, 1]))
    return {"rel_l2": max(errs), "pearson_min": min(corrs), "events": len(errs) // 2, "tokens": n}


def check_bucketing(lm: LoadedModel, runner: Runner, n: int, vocab: int) -> dict:
    ids = ids_of(n, 5, vocab)
    prefix, _ = runner.prefill(ids)
    g = lm.geometry
    heads = list(range(0, g.n_total_heads, max(1, g.n_total_heads // 16)))
    positions = [n // 3, n // 2, n - 1]
    rows = prefix_attention_rows(runner, prefix, positions, heads)  # [row, head, pos]
    gen = torch.Generator().manual_seed(0)
    buckets = torch.randint(0, 15, (n,), generator=gen).to(rows.device)
    out = bucketize(rows, buckets, 15)
    return {"max_abs_sum_error": float((out.sum(-1) - 1).abs().max()), "rows": len(positions), "heads": len(heads)}


def verdicts(res: dict) -> dict[str, bool]:
    out = {}
    for key, bound in THRESHOLDS.items():
        check, field = key.split(".", 1)
        value = res[check][field]
        out[key] = value >= bound if field.endswith("_min") else value <= bound
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b", choices=sorted(ARCHS))
    ap.add_argument("--tokens", type=int, default=32768, help="note length of the knock-in, batched and bucketing checks")
    ap.add_argument("--grad-tokens", type=int, default=2048, help="note length of the attribution check")
    ap.add_argument("--events", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4096, help="the runner's prefill chunk")
    ap.add_argument("--out", default="bench_invariants.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny Qwen3 on the CPU in float32: seconds")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    name = "smoke" if args.smoke else args.model
    if args.smoke:
        args.tokens, args.grad_tokens, args.events, args.chunk = 160, 96, 3, 64
    start = time.perf_counter()
    lm = build(name, args.tokens + 64, device)
    vocab = lm.model.config.vocab_size
    runner = Runner(lm, chunk_size=args.chunk)
    res: dict = {"card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu-smoke",
                 "torch": torch.__version__, "model": name, "dtype": str(next(lm.model.parameters()).dtype),
                 "tokens": args.tokens, "thresholds": THRESHOLDS}
    res["noop"] = check_noop(lm, min(args.tokens, 1024), vocab)
    res.update(check_knockin_and_batched(lm, runner, args.tokens, vocab, args.events))
    res["attribution"] = check_attribution(lm, runner, args.grad_tokens, vocab)
    res["bucketing"] = check_bucketing(lm, runner, args.tokens, vocab)
    sync(device)
    res["wall_s"] = time.perf_counter() - start
    res["pass"] = verdicts(res)
    res["all_pass"] = all(res["pass"].values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
