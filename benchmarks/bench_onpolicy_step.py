"""Device benchmark of one on-policy optimizer step, OPD and GOLD, against a Vanilla CoT-KD step.

The student is the Qwen3-4B architecture and the teacher the Qwen3-14B architecture (random init,
bf16 weights, the student without an fp32 master copy), both with Qwen3's 151,936-entry
vocabulary. The note is :mod:`bench_train_step`'s: a shortlist prompt of about 29.6k tokens and a
scripted trace. Measured, each on one prompt per optimizer step with the teacher online:

- the Vanilla CoT-KD micro-step of the shared trainer (CE + top-32 KL on the trace; the
  teacher's targets precomputed), as in ``bench_train_step``;
- an OPD step (TRL's ``DistillationTrainer``): the student's rollout, capped at ``--rollout-cap``
  tokens, scored by the teacher under the generalised JSD at beta 1;
- a GOLD step off-policy (TRL's ``GOLDTrainer``, the hybrid ULD loss, logits over the completion
  window): the teacher's trace, repeated to and capped at the paper's 6,144 tokens;
- a GOLD step on-policy: the student's rollout capped at ``--rollout-cap`` tokens.

Rollouts (``--rollout``): ``hf``, transformers' generation inside TRL's trainer; ``vllm``, TRL's
colocated vLLM engine taking ``--rollout-gpu-memory`` of the GPU (the train stage's
``rollout_gpu_memory``), as the paper ran OPD. With ``vllm`` the random student is saved once to
a temporary directory with the padded tokenizer, each measured student is loaded from there (TRL
builds the engine from ``model.name_or_path``), the recorded keys carry ``_vllm``
(``opd_step_vllm_s``, ``gold_on_policy_step_vllm_s``, their ``_peak_gib``; the off-policy GOLD
step is measured with the engine resident beside it), and ``rollout_engine_start_s`` is how long
building the first engine took (``<step>_rollout_engine_start_s`` each). The peak GPU memory
includes the engine's, which it allocates through PyTorch. A random model rarely stops, so a
rollout runs to the cap. Each time is the second of two steps (the first warms up), with its
peak GPU memory. The SmolLM2 tokenizer (``carry/smollm2-tokenizer``) is padded with placeholder
tokens to the models' vocabulary, so sampled ids decode and re-encode.

Usage: python benchmarks/bench_onpolicy_step.py --out results.json [--smoke] [--rollout vllm]
(``--smoke``: every step above on tiny models on the CPU with HF rollouts (TRL's colocated vLLM
engine needs CUDA), a short note, rollouts capped at 8 tokens and the teacher's trace at 16, the
tiny architecture's vocabulary; the carried tokenizer or, where it is absent, the embedded one:
seconds.)
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

from bench_instrument import ARCHS, SMOKE_ARCH  # noqa: E402
from bench_train_step import long_note, smoke_tokenizer, student_setup, timed  # noqa: E402

from mistill.distill.arms import resolve_arm  # noqa: E402
from mistill.distill.gold import capped_completion, padded_tokenizer, train_gold  # noqa: E402
from mistill.distill.objective import micro_step_loss  # noqa: E402
from mistill.distill.onpolicy import ROLLOUT_GPU_MEMORY, RolloutEngine, save_rollout_model, train_opd  # noqa: E402
from mistill.distill.trainer import RecipeConfig, autocast, prepare_student  # noqa: E402
from mistill.distill.note_data import build_note_data
from mistill.instrument.events import extract_events

GOLD_CAP = 6144  # the paper's GOLD rollout cap, to which the teacher's traces were cut


def build_model(name: str, vocab: int, device: str, *, smoke: bool):
    """A random model of the architecture (a 2-layer one in the smoke check), bf16, on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen3Config  # deferred: transformers is slow to import

    arch = dict(ARCHS[name], vocab_size=vocab)
    if smoke:
        arch.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
    cfg = Qwen3Config(**arch, max_position_embeddings=65536, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model


def load_saved(directory: Path, device: str):
    """The student saved in ``directory``, bf16 on ``device``; its ``name_or_path`` is the
    directory, from which TRL builds the colocated engine."""
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map=device)


class EngineStartTimer:
    """Times each start of TRL's colocated vLLM engine (``VLLMGeneration._init_vllm``)."""

    def __init__(self) -> None:
        from trl.generation.vllm_generation import VLLMGeneration  # deferred: TRL is optional and slow to import

        self.starts: list[float] = []
        timer, init = self, VLLMGeneration._init_vllm

        def timed_init(generation) -> None:
            t = time.perf_counter()
            init(generation)
            timer.starts.append(time.perf_counter() - t)

        VLLMGeneration._init_vllm = timed_init


class StepTimer:
    """A transformers callback: wall time and peak GPU memory of each optimizer step."""

    def __init__(self) -> None:
        from transformers import TrainerCallback  # deferred: transformers is slow to import

        timer = self
        self.steps: list[tuple[float, float]] = []

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                timer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")
                timer.steps.append((time.perf_counter() - timer._t, peak))

        self.callback = _Callback()


def vanilla_step(tokenizer: str, extra_lines: int, device: str, *, smoke: bool) -> tuple[dict, str, str]:
    """The Vanilla CoT-KD micro-step of the shared trainer (``bench_train_step``'s setup and step):
    the results so far, the note's prompt and its trace."""
    setup = student_setup(tokenizer, extra_lines, smoke=smoke)
    lm, nd, targets, pairing = (setup[k] for k in ("lm", "nd", "targets", "pairing"))
    res: dict = dict(setup["res"])
    recipe = RecipeConfig(precision="bf16")
    model = prepare_student(lm.model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    arm = resolve_arm("vanilla-bf16")

    def step():
        with autocast(recipe, torch.device(device)):
            loss, _ = micro_step_loss(model, lm, nd, targets, pairing, {}, arm)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    ts, peaks = [], []
    for _ in range(2):
        t, peak, _ = timed(step)
        ts.append(t)
        peaks.append(peak)
    res["vanilla_step_s"], res["vanilla_step_peak_gib"] = float(np.median(ts)), max(peaks)
    return res, nd.inp.prompt.text, nd.inp.trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="carry/smollm2-tokenizer")
    ap.add_argument("--extra-lines", type=int, default=950)
    ap.add_argument("--rollout-cap", type=int, default=256)
    ap.add_argument("--gold-cap", type=int, default=GOLD_CAP, help="the teacher trace cap, off-policy GOLD")
    ap.add_argument("--steps", default="opd,gold_off_policy,gold_on_policy", help="which on-policy steps to time")
    ap.add_argument("--no-vanilla", action="store_true", help="skip the Vanilla CoT-KD step")
    ap.add_argument("--full-logits", action="store_true",
                    help="GOLD without the completion window: upstream's full-sequence logits")
    ap.add_argument("--rollout", choices=("hf", "vllm"), default="hf",
                    help="the rollout engine: transformers' generation or TRL's colocated vLLM engine")
    ap.add_argument("--rollout-gpu-memory", type=float, default=ROLLOUT_GPU_MEMORY,
                    help="the colocated engine's share of the GPU's memory (--rollout vllm)")
    ap.add_argument("--out", default="bench_onpolicy_step.json")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: check the script runs")
    args = ap.parse_args()
    if args.smoke and args.rollout == "vllm":
        ap.error("--smoke runs on the CPU with HF rollouts; TRL's colocated vLLM engine needs a CUDA GPU")
    device = "cpu" if args.smoke else "cuda"
    vocab = ARCHS["qwen3-4b"]["vocab_size"]
    if args.tokenizer == "embedded":  # the embedded SmolLM2 tokenizer, saved as a directory
        args.tokenizer = smoke_tokenizer(args.tokenizer)
    if args.smoke:  # a short note, short rollouts, the tiny models' vocabulary
        args.tokenizer, args.extra_lines = smoke_tokenizer(args.tokenizer), 0
        args.rollout_cap, args.gold_cap, vocab = 8, 16, SMOKE_ARCH["vocab_size"]
    vllm = args.rollout == "vllm"
    sfx = "_vllm" if vllm else ""

    if args.no_vanilla:
        from transformers import PreTrainedTokenizerFast  # deferred: transformers is slow to import

        base = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
        corpus, note = long_note(base, args.extra_lines, inventory_size=60 if args.smoke else 1100)
        events = extract_events(note.note_id, note.teacher_trace, list(corpus.inventory.codes), tokenizer=base)
        nd = build_note_data(note, corpus.inventory, base, events)
        res, prompt, trace = {"card": torch.cuda.get_device_name() if device == "cuda" else "cpu-smoke",
                              "torch": torch.__version__}, nd.inp.prompt.text, nd.inp.trace
    else:
        res, prompt, trace = vanilla_step(args.tokenizer, args.extra_lines, device, smoke=args.smoke)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    res["gold_completion_window"] = not args.full_logits
    steps = args.steps.split(",")

    # the models of the on-policy steps, and a tokenizer covering their vocabulary
    from transformers import PreTrainedTokenizerFast  # deferred: transformers is slow to import

    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    tok.add_tokens([f"<|x{i}|>" for i in range(vocab - len(tok))])
    teacher = build_model("qwen3-14b", vocab, device, smoke=args.smoke)
    teacher.requires_grad_(False)
    teacher.eval()
    long_trace = trace * (1 + args.gold_cap // max(1, len(tok(trace, add_special_tokens=False)["input_ids"])))
    full = prompt + long_trace
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    completion, _ = capped_completion(full, offsets, len(prompt), args.gold_cap)
    res["gold_teacher_completion_tokens"] = sum(len(prompt) <= s < len(prompt) + len(completion) for s, _ in offsets)
    res["prompt_tokens"] = len(tok(prompt, add_special_tokens=False)["input_ids"])
    on_policy = RecipeConfig(seed=0, precision="bf16", epochs=1, grad_accum=1, max_steps=2, checkpoint_every=0)
    engine, saved, starts = None, None, None
    if vllm:  # one random student on disk, with the tokenizer the engine decodes with
        res["rollout"] = args.rollout
        saved = tempfile.TemporaryDirectory(prefix="bench-student-")
        student = build_model("qwen3-4b", vocab, device, smoke=args.smoke)
        save_rollout_model(student, padded_tokenizer(tok), Path(saved.name))
        del student
        torch.cuda.empty_cache()
        engine = RolloutEngine(gpu_memory=args.rollout_gpu_memory)  # built from the student's name_or_path
        starts = EngineStartTimer()
        res["rollout_gpu_memory"] = args.rollout_gpu_memory

    def run(name: str, train) -> None:
        if name not in steps:
            return
        if saved is not None:
            student = load_saved(Path(saved.name), device)
        else:
            student = build_model("qwen3-4b", vocab, device, smoke=args.smoke)
        student.train()
        timer = StepTimer()
        logs: list[dict] = []
        n_starts = len(starts.starts) if starts is not None else 0
        try:
            with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as out:
                train(student, Path(out), timer.callback, lambda m, s: logs.append(m))
        except torch.OutOfMemoryError as exc:  # recorded, and the next step still measured
            res[f"{name}{sfx}_out_of_memory"] = str(exc).splitlines()[0][:300]
            print(f"{name}: out of memory: {res[f'{name}{sfx}_out_of_memory']}")
            del student
            torch.cuda.empty_cache()
            return
        (t, peak) = timer.steps[-1]
        res[f"{name}_step{sfx}_s"], res[f"{name}_step{sfx}_peak_gib"] = t, peak
        lengths = [m[k] for m in logs for k in ("completions/mean_length",) if k in m]
        if lengths:
            res[f"{name}_rollout_tokens{sfx}"] = lengths[-1]
        if starts is not None and len(starts.starts) > n_starts:
            res[f"{name}_rollout_engine_start_s"] = starts.starts[n_starts]
            res.setdefault("rollout_engine_start_s", starts.starts[n_starts])
        print(f"{name}{sfx}: {t:.2f} s, peak {peak:.1f} GiB; {json.dumps(logs[-2] if len(logs) > 1 else logs)[:300]}")
        del student
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    run("opd", lambda s, out, cb, log: train_opd(
        s, teacher, tok, [prompt, prompt], on_policy, out, rollout_cap=args.rollout_cap, beta=1.0, device=device,
        log=log, callbacks=[cb], engine=engine))
    run("gold_off_policy", lambda s, out, cb, log: train_gold(
        s, teacher, tok, tok, [(prompt, completion)] * 2, on_policy, out, rollout_cap=args.gold_cap,
        on_policy_fraction=0.0, beta=0.5, hybrid=True, device=device, log=log, callbacks=[cb],
        completion_window=not args.full_logits, engine=engine))
    run("gold_on_policy", lambda s, out, cb, log: train_gold(
        s, teacher, tok, tok, [(prompt, completion)] * 2, on_policy, out, rollout_cap=args.rollout_cap,
        on_policy_fraction=1.0, beta=0.5, hybrid=True, device=device, log=log, callbacks=[cb],
        completion_window=not args.full_logits, engine=engine))
    if saved is not None:
        saved.cleanup()
    for name in ("opd", "gold_off_policy", "gold_on_policy"):
        if f"{name}_step{sfx}_s" in res and "vanilla_step_s" in res:
            res[f"{name}{sfx}_over_vanilla"] = res[f"{name}_step{sfx}_s"] / res["vanilla_step_s"]
    res["rollout_cap"] = args.rollout_cap
    print(json.dumps(res, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
