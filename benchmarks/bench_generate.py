"""Device benchmark of generation with the HF backend: a prompt's prefill and the time per new token.

The runbook's estimates of ``generate`` (the teacher's traces) and ``evaluate`` (a model's
answers) are notes x (prefill + trace tokens x time per token). This measures both terms on
random-init real architectures in bf16 (``bench_instrument.ARCHS``, and SmolLM3-3B's), batch 1, greedy decoding
forced to run ``--new`` tokens, through ``transformers``' ``generate`` (the HF backend; the
vLLM backend batches notes and is faster, so these are upper bounds for it).

Usage: python benchmarks/bench_generate.py --model qwen3-14b --prompt 36000 --new 256 --out raw.json

``--smoke``: the same calls on a tiny Qwen3 (``bench_instrument.SMOKE_ARCH``, float32) on the CPU,
a 24-token prompt and 4 new tokens: seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_instrument import build, card, empty_cache, peak_gib, reset_peak, sync  # noqa: E402


def build_smollm3(max_pos: int):
    """SmolLM3-3B's architecture (transformers' ``SmolLM3Config`` defaults: 36 layers of 16 heads, 4
    key-value heads, hidden 2048, a 128,256-entry vocabulary, no rotary embedding on every fourth
    layer), random init in bf16."""
    from transformers import AutoModelForCausalLM, SmolLM3Config  # deferred: transformers is slow to import

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(SmolLM3Config(max_position_embeddings=max_pos), dtype=torch.bfloat16)
    return model.eval()


def measure(name: str, prompt: int, new: int, reps: int = 2, *, device: str = "cuda") -> dict:
    max_pos = prompt + new + 1024
    if name == "smollm3-3b":
        model = build_smollm3(max_pos)
    else:
        model = build(name, max_pos=max_pos, device=device,
                      dtype=torch.bfloat16 if device == "cuda" else torch.float32).model
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device, generator=gen)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    with torch.inference_mode():
        model.generate(ids[:, :1024], max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
        sync()
        reset_peak()
        prefill = []
        for _ in range(reps):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            sync()
            prefill.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        sync()
        total = time.perf_counter() - t
    assert out.shape[1] == prompt + new
    prefill_s = min(prefill)
    return {"prompt_tokens": prompt, "new_tokens": new, "prefill_s": prefill_s, "generate_s": total,
            "decode_per_token_s": (total - prefill_s) / (new - 1),
            "peak_gib": peak_gib()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--prompt", type=int, nargs="+", default=[36000])
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: seconds")
    args = ap.parse_args()
    device = "cuda"
    if args.smoke:
        args.model, args.prompt, args.new, device = "smoke", [24], 4, "cpu"
    out: dict = {"card": card(args.smoke), "model": args.model}
    for prompt in args.prompt:
        r = measure(args.model, prompt, args.new, device=device)
        for key, value in r.items():
            out[f"p{prompt}.{key}"] = value
        print(json.dumps({"prompt": prompt, **r}), flush=True)
        empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
