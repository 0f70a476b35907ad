"""Device benchmark of one optimizer micro-step: Vanilla CoT-KD against Mistill.

Qwen3-4B architecture (random init) as the student, a synthetic note whose prompt lists ~2,000
candidate lines (about 30k tokens with the note) and whose scripted trace names 25 codes. The
teacher targets come from the same random model (the cost of a targets pass is reported too).
Measured with bf16 weights (no master copy): the fwd+bwd floor (the model's forward and backward
with gradient checkpointing, a trivial loss), a Vanilla micro-step (CE + top-32 KL, chunked
logits) and a Mistill micro-step (plus the pooled attention rows of 40 heads per phase at every
supervised row, the attention and interaction terms), each followed by the AdamW step; peak GPU
memory of each; and the Mistill step's peak with fp32 master weights under bf16 autocast.

Needs the SmolLM2 tokenizer files (carry/smollm2-tokenizer) and simple-icd-10-cm (a wheel in
carry/wheels). Usage: python benchmarks/bench_train_step.py --out results.json

``--smoke``: the targets pass, the floor and the Vanilla and Mistill steps (not the fp32 step) on a
tiny Qwen3 on the CPU, a short note over a 60-code inventory (the carried tokenizer, or the
embedded one with the same vocabulary where it is absent): seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_instrument import build  # noqa: E402
from torch.profiler import ProfilerActivity, profile

from mistill.data.inventory import Inventory, billable_codes  # noqa: E402
from mistill.data.synthetic import make_synthetic_corpus, make_synthetic_inventory  # noqa: E402
from mistill.distill.arms import resolve_arm  # noqa: E402
from mistill.distill.note_data import build_note_data  # noqa: E402
from mistill.distill.objective import compute_note_targets, micro_step_loss, pair_rows  # noqa: E402
from mistill.distill.pools import model_pools  # noqa: E402
from mistill.distill.trainer import RecipeConfig, prepare_student, autocast  # noqa: E402
from mistill.instrument.calibration import NoteImportance, calibrate, head_sets_json  # noqa: E402
from mistill.instrument.events import extract_events  # noqa: E402
from mistill.models.loading import LoadedModel  # noqa: E402
from mistill.models.loading import embedded_tokenizer, tiny_model
import mistill.distill.objective as obj


def random_head_sets(lm: LoadedModel, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    kinds = np.array(["P1"] * 6 + ["P2"] * 6 + ["P2C"] * 6 + ["NULL"] * 6)
    notes = [NoteImportance(note_id=f"n{i}", patient_id=f"p{i}", kinds=kinds,
                            importance=rng.normal(size=(kinds.size, lm.geometry.n_total_heads)).astype(np.float32))
             for i in range(8)]
    return head_sets_json(calibrate(notes, seed=0), lm.geometry.head_names())


def long_note(tokenizer, extra_lines: int, inventory_size: int = 1100):
    base = make_synthetic_inventory(seed=7, inventory_size=inventory_size)
    have = set(base.codes)
    by_cat: dict[str, list[str]] = {}
    for c in sorted(billable_codes()):
        if c not in have:
            by_cat.setdefault(c[:3], []).append(c)
    extra: list[str] = []
    for codes in by_cat.values():  # whole categories of 2-6 codes, so every code has siblings
        if 2 <= len(codes) <= 6 and len(extra) < extra_lines:
            extra += codes
    inv = Inventory.billable(codes=list(base.codes) + extra)
    n_codes = min(25, max(2, inventory_size // 10))
    corpus = make_synthetic_corpus(n_notes=1, seed=7, n_codes_range=(n_codes, n_codes), inventory=inv)
    return corpus, corpus.notes[0]


def smoke_tokenizer(tokenizer: str) -> str:
    """``tokenizer`` where that directory exists, else the embedded SmolLM2 tokenizer (the same
    vocabulary) saved to a new temporary directory: the smoke checks run without the carried files."""
    if Path(tokenizer).is_dir():
        return tokenizer

    path = tempfile.mkdtemp(prefix="bench-tok-")
    embedded_tokenizer().save_pretrained(path)
    return path


def student_setup(tokenizer: str, extra_lines: int, *, smoke: bool = False) -> dict:
    """The benchmark's student (random Qwen3-4B on this process's GPU, or a tiny model on the CPU),
    its long note, the pools, the teacher targets (from the same model) and the row pairing."""
    from transformers import PreTrainedTokenizerFast  # deferred: transformers is slow to import

    # ``embedded``: the embedded SmolLM2 tokenizer, saved to a temporary directory first
    tok = PreTrainedTokenizerFast.from_pretrained(smoke_tokenizer(tokenizer) if tokenizer == "embedded" else tokenizer)
    # the smoke check: a short note over a small inventory, no extra lines (a tiny model on the CPU)
    corpus, note = long_note(tok, 0 if smoke else extra_lines, inventory_size=60 if smoke else 1100)
    events = extract_events(note.note_id, note.teacher_trace, list(corpus.inventory.codes), tokenizer=tok)
    if smoke:
        lm = tiny_model("qwen3", layers=2, heads=4, kv_heads=2, d_head=16, d_model=64, tokenizer=tok)
    else:
        lm = build("qwen3-4b", max_pos=65536)
    lm = LoadedModel(model=lm.model, tokenizer=tok, geometry=lm.geometry, spec=lm.spec)
    nd = build_note_data(note, corpus.inventory, tok, events)
    pools = model_pools(random_head_sets(lm), lm.geometry.head_names(), k=40)
    device = torch.device("cpu" if smoke else "cuda")
    res: dict = {"card": "cpu-smoke" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
                 "tokens": int(nd.input_ids.numel()), "trace_tokens": int(nd.input_ids.numel() - nd.trace_start)}
    lm.model.eval()
    t, peak, targets = timed(lambda: compute_note_targets(lm, nd, pools, window=8))
    res.update({"targets_pass_s": t, "targets_pass_peak_gib": peak, "supervised_rows": int(len(targets["rows_pos"])),
                "supervised_events": int(len(targets["m"]))})
    pairing = pair_rows(nd, nd.realized.values(), targets, window=8, teacher_trace_start=nd.trace_start)
    return {"lm": lm, "nd": nd, "pools": pools, "targets": targets, "pairing": pairing, "device": device,
            "res": res}


def timed(fn):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t, torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"), out


def profile_steps(step, device) -> dict:
    """Peak-memory attribution of a Vanilla and a Mistill step, and a profile of Mistill's."""
    from memtrace import PeakTrace  # deferred: memtrace only when needed

    out: dict = {}
    for name in ("vanilla-bf16", "mistill"):
        try:
            with PeakTrace() as pt:
                step(name)()
        except SystemError as exc:  # the allocator's stack capture and the backward disagreed
            print(f"memtrace of {name} failed: {exc!r}")
            torch.cuda.memory._record_memory_history(enabled=None)
            continue
        rep = pt.report()
        out[f"memtrace_{name}"] = rep
        print(f"== {name}: peak {rep['peak_gib']:.2f} GiB (baseline {rep['baseline_gib']:.2f})")
        for site, gib, n in rep["at_peak"]:
            print(f"   {gib:7.3f} GiB  {n:5d}  {site}")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in ("vanilla-bf16", "mistill"):
        with profile(activities=acts) as prof:
            step(name)()
        avg = prof.key_averages()

        def dev_t(e):
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        top_dev = sorted(avg, key=lambda e: -dev_t(e))[:30]
        top_cpu = sorted(avg, key=lambda e: -e.cpu_time_total)[:30]
        ranges = [e for e in avg if e.key.startswith("mistill/")]
        out[f"profile_{name}"] = {
            "device_total_ms": sum(dev_t(e) for e in avg) / 1e3,
            "top_device": [(e.key, dev_t(e) / 1e3, e.count) for e in top_dev],
            "top_cpu_total": [(e.key, e.cpu_time_total / 1e3, e.count) for e in top_cpu],
            "ranges": [(e.key, e.cpu_time_total / 1e3, getattr(e, "device_time_total", 0) / 1e3, e.count)
                       for e in ranges]}
        print(f"== profile {name}: device total {out[f'profile_{name}']['device_total_ms']:.1f} ms")
        for k, ms, n in out[f"profile_{name}"]["top_device"][:20]:
            print(f"   dev {ms:9.2f} ms  {n:6d}  {k[:90]}")
        for k, ms, n in out[f"profile_{name}"]["top_cpu_total"][:15]:
            print(f"   cpu {ms:9.2f} ms  {n:6d}  {k[:90]}")
        for k, cms, dms, n in out[f"profile_{name}"]["ranges"]:
            print(f"   range {k}: cpu {cms:.1f} ms, device {dms:.1f} ms, x{n}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="carry/smollm2-tokenizer")
    ap.add_argument("--extra-lines", type=int, default=950)
    ap.add_argument("--out", default="bench_train_step.json")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: check the script runs")
    ap.add_argument("--diagnose", action="store_true",
                    help="peak memory of Mistill variants (terms, phases, row chunk) instead of the fp32 step")
    ap.add_argument("--profile", action="store_true",
                    help="who holds memory at the peak of each step, and the top kernels / host ops of Mistill's")
    args = ap.parse_args()
    if args.smoke:
        args.tokenizer = smoke_tokenizer(args.tokenizer)
    setup = student_setup(args.tokenizer, args.extra_lines, smoke=args.smoke)
    lm, nd, pools, targets, pairing, device = (setup[k] for k in ("lm", "nd", "pools", "targets", "pairing", "device"))
    res: dict = dict(setup["res"])
    tok = lm.tokenizer

    recipe = RecipeConfig(precision="bf16")
    model = prepare_student(lm.model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)

    def floor():
        out = model.model(input_ids=nd.input_ids.to(device).unsqueeze(0), use_cache=False)
        out.last_hidden_state[0, nd.trace_start:].float().pow(2).mean().backward()
        opt.zero_grad(set_to_none=True)

    def step(arm_name: str):
        arm = resolve_arm(arm_name)

        def run():
            with autocast(recipe, device):
                loss, parts = micro_step_loss(model, lm, nd, targets, pairing, pools, arm)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return parts
        return run

    floor()  # warm-up (allocator, kernels)
    step("vanilla-bf16")()
    step("mistill")()
    for name, fn in (("floor_fwd_bwd", floor), ("vanilla_step", step("vanilla-bf16")), ("mistill_step", step("mistill"))):
        ts = []
        for _ in range(3):
            t, peak, _ = timed(fn)
            ts.append(t)
        res[f"{name}_s"] = float(np.median(ts))
        res[f"{name}_peak_gib"] = peak
    res["mistill_over_vanilla"] = res["mistill_step_s"] / res["vanilla_step_s"]
    res["vanilla_over_floor"] = res["vanilla_step_s"] / res["floor_fwd_bwd_s"]
    if args.profile:
        res.update(profile_steps(step, device))
        print(json.dumps(res, indent=2))
        Path(args.out).write_text(json.dumps(res, indent=2))
        return
    if args.diagnose:
        for label, arm_name, overrides, chunk in [
                ("attention_only", "mistill", "terms=attention", 1024),
                ("p1_only", "mistill", "lambda_p2=0", 1024),
                ("p2_only", "mistill", "lambda_p1=0", 1024),
                ("row_chunk_64", "mistill", "", 64)]:
            arm = resolve_arm(arm_name, overrides)
            default = obj.RowSetBlocks.__init__.__kwdefaults__["row_chunk"]
            obj.RowSetBlocks.__init__.__kwdefaults__["row_chunk"] = chunk

            def run(arm=arm):
                with autocast(recipe, device):
                    loss, _ = micro_step_loss(model, lm, nd, targets, pairing, pools, arm)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            run()
            t, peak, _ = timed(run)
            obj.RowSetBlocks.__init__.__kwdefaults__["row_chunk"] = default
            res[f"diag_{label}_s"] = t
            res[f"diag_{label}_peak_gib"] = peak
        print(json.dumps(res, indent=2))
        Path(args.out).write_text(json.dumps(res, indent=2))
        return
    del opt, model
    if args.smoke:  # the fp32 step needs the 4B model's memory on the card
        print(json.dumps(res, indent=2))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        return
    torch.cuda.empty_cache()

    # fp32 master weights under bf16 autocast: the peak of a Mistill step with its AdamW step
    lm32 = build("qwen3-4b", max_pos=65536, dtype=torch.float32)
    lm32 = LoadedModel(model=lm32.model, tokenizer=tok, geometry=lm32.geometry, spec=lm32.spec)
    recipe32 = RecipeConfig(precision="fp32")
    model32 = prepare_student(lm32.model, recipe32)
    opt32 = torch.optim.AdamW(model32.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    arm = resolve_arm("mistill-fp32")

    def step32():
        with autocast(recipe32, torch.device("cuda")):
            loss, _ = micro_step_loss(model32, lm32, nd, targets, pairing, pools, arm)
        loss.backward()
        opt32.step()
        opt32.zero_grad(set_to_none=True)

    step32()
    t, peak, _ = timed(step32)
    res["mistill_fp32_master_step_s"] = t
    res["mistill_fp32_master_peak_gib"] = peak
    print(json.dumps(res, indent=2))
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
