"""Where the batched HF backend's time goes: prefill, compilation and the steady decode step.

The batched HF path (``generate_hf_many``) decodes through ``model.generate`` with transformers'
static key/value cache, compiled on CUDA, and a chunked prefill. This benchmark times that call's
parts at the paper's student shape (random-init Qwen3-4B in bf16, a 36,864-token prompt of random
ids, one row left-padded as in a real batch): a clock in the logits processors records when each
step's logits are ready, so the first interval is the prefill (and the first compilation), the
next ones are decode steps. Variants, in this order:

- ``b4_static_compile_greedy_1`` / ``_2``: batch 4, the stage's options; the second call reuses the
  compiled graphs (the steady state);
- ``b4_static_compile_sampled``: the same with the per-row seeded sampler (:class:`SeededSampler`);
- ``b4_static_eager_greedy``: the static cache without compilation;
- ``b4_dynamic_greedy``: transformers' dynamic cache, nothing compiled;
- ``b4_static_compile_prof``: 8 steps under ``torch.profiler`` (its table is printed);
- ``b16_static_compile_greedy``: batch 16 (a new batch size compiles again), if time is left.

``--plan grouped`` times the path ``generate_hf_many`` takes now, decode steps through
:func:`mistill.models.grouped_attention.grouped_attention_forward` (each key/value head read once,
no ``repeat_kv``), at ``--batch`` rows of ``--model`` built on the card from its config (random
weights, nothing written to disk):

- ``b<B>_grouped_compile_1``: ``--new`` tokens, the call that compiles (``_2``, a second such call,
  only in the smoke mode);
- ``b<B>_grouped_long``: ``--long-new`` tokens (the paper's trace length), if ``--budget-s`` allows;
  the same cache shape, so it reuses the compiled step and its median step is the steady state.

``--smoke``: a 2-layer Qwen3 on the CPU, a 24-token prompt, eager, both plans (seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_sampling import model_config, model_dir  # noqa: E402

from mistill.evaluation.generation import DecodingConfig, SeededSampler  # noqa: E402
from mistill.models.grouped_attention import use_grouped_decode_attention  # noqa: E402


class StepClock(LogitsProcessor):
    """Records the time at which each step's logits are ready (after a device sync)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def timed_generate(model, batch: int, prompt: int, new: int, cache_len: int, *, static: bool = True,
                   compile_: bool = True, sampled: bool = False, chunk: int | None = 2048,
                   profile: bool = False, grouped: bool = False) -> dict:
    """One ``generate`` call over ``batch`` random prompts of ``prompt`` ids ([B, prompt]), forced to
    ``new`` tokens; returns its total, prefill and per-step seconds and the peak device memory."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1000, 40000, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[0, :min(100, prompt // 4)] = 0  # one left-padded row, as in a real batch
    clock = StepClock()
    processors: list[LogitsProcessor] = [clock]
    if sampled:
        gens = [torch.Generator(device=device).manual_seed(i) for i in range(batch)]
        processors.append(SeededSampler(DecodingConfig(max_new_tokens=new), gens))
    kwargs: dict = dict(attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                        logits_processor=LogitsProcessorList(processors), pad_token_id=0, eos_token_id=None,
                        temperature=None, top_k=None, top_p=None)
    if static:
        kwargs.update(cache_implementation="static", max_cache_len=cache_len)
        if chunk and device.type == "cuda":
            kwargs["prefill_chunk_size"] = chunk
    if not compile_ or device.type != "cuda":
        kwargs["disable_compile"] = True
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if grouped:
            stack.enter_context(use_grouped_decode_attention(model))
        if profile:
            from torch.profiler import ProfilerActivity  # deferred: torch.profiler is slow to import
            from torch.profiler import profile as torch_profile  # deferred: torch.profiler is slow to import

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch_profile(activities=activities) as prof:
                model.generate(ids, **kwargs)
            sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
        else:
            model.generate(ids, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return {"total_s": total, "prefill_s": clock.times[0] - start, "first_steps_s": steps[:4],
            "step_median_s": statistics.median(steps) if steps else None, "steps": len(clock.times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", choices=("breakdown", "grouped"), default="breakdown")
    ap.add_argument("--model", choices=("qwen3-4b", "qwen3-14b", "smollm3-3b"), default="qwen3-4b")
    ap.add_argument("--prompt", type=int, default=36864, help="prompt tokens (a multiple of the prefill chunk)")
    ap.add_argument("--new", type=int, default=48, help="new tokens of the timed short calls")
    ap.add_argument("--batch", type=int, default=16, help="rows of the grouped plan's calls")
    ap.add_argument("--long-new", type=int, default=6000, help="new tokens of the grouped plan's long call")
    ap.add_argument("--tokenizer", default="carry/smollm2-tokenizer")
    ap.add_argument("--model-root", default="/root/bench-models")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip the last call when this much has passed")
    ap.add_argument("--out", default="bench_hf_decode.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: seconds")
    args = ap.parse_args()
    t0 = time.perf_counter()
    device, name = ("cpu", "smoke") if args.smoke else ("cuda", args.model)
    if args.smoke:
        args.prompt, args.new, args.long_new, args.batch, args.tokenizer = 24, 4, 6, 2, "embedded"
        args.model_root = tempfile.mkdtemp(prefix="bench-hf-decode-")
    grouped_plan = args.plan == "grouped"
    cache_len = args.prompt + (max(args.new, args.long_new) if grouped_plan else 2048)
    if grouped_plan and not args.smoke:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(model_config(name, cache_len), dtype=torch.bfloat16).eval()
        model.generation_config.eos_token_id = None
    else:
        path = model_dir(name, Path(args.model_root), cache_len, args.tokenizer, device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    prefix = f"{name}.p{args.prompt}"
    res: dict = {"card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu-smoke",
                 "torch": torch.__version__, "attn_implementation": model.config._attn_implementation,
                 f"{prefix}.setup_s": time.perf_counter() - t0}

    def run(tag: str, batch: int, new: int, **kw) -> None:
        r = timed_generate(model, batch, args.prompt, new, cache_len, **kw)
        r["per_token_decode_ms"] = 1000 * r["step_median_s"] / batch if r["step_median_s"] else None
        for key, value in r.items():
            res[f"{prefix}.{tag}.{key}"] = value
        print(tag, json.dumps(r), f"elapsed {time.perf_counter() - t0:.0f} s", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))

    if grouped_plan or args.smoke:
        b = args.batch
        run(f"b{b}_grouped_compile_1", b, args.new, grouped=True)
        if args.smoke:  # on the card the long call's steps are the steady state
            run(f"b{b}_grouped_compile_2", b, args.new, grouped=True)
        if time.perf_counter() - t0 < args.budget_s:
            run(f"b{b}_grouped_long", b, args.long_new, grouped=True)
    if grouped_plan:
        return
    half = max(2, args.new // 2)
    run("b4_static_compile_greedy_1", 4, args.new)
    run("b4_static_compile_greedy_2", 4, args.new)
    run("b4_static_compile_sampled", 4, args.new, sampled=True)
    run("b4_static_eager_greedy", 4, half, compile_=False)
    run("b4_dynamic_greedy", 4, half, static=False, compile_=False)
    run("b4_static_compile_prof", 4, max(2, args.new // 6), profile=True)
    if time.perf_counter() - t0 < args.budget_s:
        run("b16_static_compile_greedy", 16, args.new)


if __name__ == "__main__":
    main()
