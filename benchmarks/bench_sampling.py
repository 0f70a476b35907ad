"""Device benchmark of sampling through the platform's backends: vLLM, the batched HF path, and
the HF path under the evidence-flip test's decode-regime key mask.

The runbook costs every ``generate`` and ``evaluate`` step (and the on-policy rollouts) as notes
x seconds per note, read from these figures. Each run gives ``batch`` prompts of ``--prompt``
tokens to the backend in one :meth:`generate_many` call and times it until every prompt has
``new`` tokens, each prompt's prefill included and the engine's start excluded (recorded
apart). The backends are the stages' own (:class:`~mistill.evaluation.backends.VLLMBackend`,
:class:`~mistill.evaluation.backends.HFBackend`) with the paper's sampling (temperature 0.6,
top-p 0.95, top-k 20, a seed per prompt); a random-init model rarely stops, and the end-of-text
tokens are ignored, so every prompt runs to ``new`` tokens.

Models: random-init real architectures in bf16 (``bench_instrument.ARCHS``'s Qwen3-4B and
Qwen3-14B, SmolLM3-3B from transformers' defaults), saved once to ``--model-root`` (vLLM loads
a directory) with a tokenizer padded by placeholder tokens to the model's vocabulary; the
prompts are strings of placeholder tokens, so each tokenizes to exactly ``--prompt`` ids.

``--engine hf_masked`` times the causal half of the evidence-flip test (App. N.4) as ``flip_test``
runs it (:class:`~mistill.evaluation.backends.KeyMaskedHFBackend`: the prompt prefilled clean,
then every decode step through the grouped attention with ``--mask-heads`` heads kept from
``--mask-span`` prompt positions, compiled on CUDA like the unmasked path); ``hf_masked_eager``
is the same with the decode step left uncompiled (the model's ``disable_compile``), as it ran
before the mask could be compiled. The heads are a seeded draw over every layer (the plan's
top-40 sets spread across layers too); the span sits at the middle of each prompt.

``--warmup`` runs the largest ``batch x new`` once, untimed, before the timed runs: a compiled
engine compiles its decode step (and sizes its static cache) there, so the timed runs measure
decoding alone; the warm-up's wall is recorded as ``warmup_s``. ``--check-mask`` first checks on
a small float32 model that the compiled masked step draws the uncompiled one's greedy tokens
(:func:`check_compiled_mask`; ``mask_check.*``).

Records, per run ``b<batch>.n<new>``: ``wall_s``, ``tokens`` (generated), ``per_token_s``
(wall over tokens: the aggregate rate, prefills included); per engine ``engine_start_s`` and
``used_gib`` (device memory in use after the runs, every process's: vLLM reserves
``gpu_memory_utilization`` of the card for weights and KV cache at start).

Usage (on the GPU machine, vLLM's CUDA build installed):
    python3 benchmarks/bench_sampling.py --engine vllm --model qwen3-4b --prompt 36000 \\
        --runs 1x256 16x256 16x6000 1x6000 --tokenizer carry/smollm2-tokenizer --out raw.json
    python3 benchmarks/bench_sampling.py --engine hf_batched,hf_masked --model qwen3-14b --prompt 30000 \\
        --runs 8x32 8x256 --mask-heads 40 --mask-span 64 --tokenizer carry/smollm2-tokenizer --out raw.json
    python3 benchmarks/bench_sampling.py --smoke      # a tiny model on the CPU, the HF paths, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_instrument import ARCHS  # noqa: E402

from mistill.evaluation.backends import HFBackend, KeyMaskedHFBackend, VLLMBackend  # noqa: E402
from mistill.evaluation.generation import DecodingConfig, generate_hf_many  # noqa: E402
from mistill.models.geometry import head_geometry  # noqa: E402
from mistill.models.loading import EMBEDDED_DEFAULT, LoadedModel, load_tokenizer  # noqa: E402

SMOKE_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=49152 + 64, tie_word_embeddings=True)


def model_config(name: str, max_pos: int):
    """The transformers config of ``name`` (``smoke``: a 2-layer Qwen3) with ``max_pos`` positions."""
    from transformers import Qwen3Config, SmolLM3Config  # deferred: transformers is slow to import

    if name == "smollm3-3b":
        return SmolLM3Config(max_position_embeddings=max_pos)
    arch = SMOKE_ARCH if name == "smoke" else ARCHS[name]
    return Qwen3Config(**arch, max_position_embeddings=max_pos, rms_norm_eps=1e-6)


MASKED_ENGINES = ("hf_masked", "hf_masked_eager")
"""The engines that run under the key mask (compiled, and uncompiled)."""
ENGINES = ("vllm", "hf_batched", *MASKED_ENGINES)


def base_vocab(source: str) -> int:
    """Entries of the tokenizer at ``source`` (``embedded``: the embedded SmolLM2's) before padding:
    the first placeholder token's id."""
    return len(load_tokenizer(EMBEDDED_DEFAULT) if source == "embedded" else load_tokenizer(source))


def padded_tokenizer(source: str, vocab: int):
    """The tokenizer at ``source`` (``embedded``: the embedded SmolLM2's) with placeholder tokens
    ``<|x<i>|>`` added up to ``vocab`` entries."""
    tok = load_tokenizer(EMBEDDED_DEFAULT) if source == "embedded" else load_tokenizer(source)
    tok.add_tokens([f"<|x{i}|>" for i in range(vocab - len(tok))])
    return tok


def model_dir(name: str, root: Path, max_pos: int, tokenizer_source: str, device: str) -> Path:
    """A directory with the random-init model ``name`` in bf16 and its padded tokenizer, written
    once (a later call with a window at most as large reuses it)."""
    path = root / name
    done = path / ".bench-max-pos"
    if done.is_file() and int(done.read_text()) >= max_pos:
        return path
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    cfg = model_config(name, max_pos)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None  # never stops early: every run is full length
    model.save_pretrained(path)
    padded_tokenizer(tokenizer_source, cfg.vocab_size).save_pretrained(path)
    done.write_text(str(max_pos))
    print(f"wrote {name} to {path} in {time.perf_counter() - start:.1f} s", flush=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def prompts(tokenizer, n: int, length: int, vocab_from: int, vocab: int, seed: int) -> list[str]:
    """``n`` distinct strings of ``length`` placeholder tokens (each one token id)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab_from, vocab, (n, length), generator=g)
    return ["".join(f"<|x{int(i) - vocab_from}|>" for i in row) for row in ids]


def used_gib() -> float:
    if not torch.cuda.is_available():
        return float("nan")
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2 ** 30


def masked_heads(n_layers: int, n_heads: int, k: int) -> list[int]:
    """``k`` flat heads (``layer * n_heads + head``) drawn with a fixed seed over every layer."""
    g = torch.Generator().manual_seed(0)
    return sorted(int(h) for h in torch.randperm(n_layers * n_heads, generator=g)[:k])


def span(prompt: int, width: int) -> tuple[int, ...]:
    """The ``width`` prompt positions the key mask hides: the middle of a ``prompt``-token prompt."""
    start = max(0, (prompt - width) // 2)
    return tuple(range(start, min(prompt, start + width)))


def open_backend(engine: str, path: Path, decoding: DecodingConfig, max_len: int, device: str,
                 mask_heads: int = 0):
    """The stage's backend for the model at ``path``; vLLM at ``max_len`` positions, eager
    without CUDA; ``hf_masked``: the key-masked HF backend over ``mask_heads`` drawn heads (its
    prompts' spans are set before each call)."""
    if engine == "vllm":
        return VLLMBackend(str(path), decoding, dtype="bfloat16",
                           engine_overrides={"max_model_len": max_len, "gpu_memory_utilization": 0.9,
                                             "enable_prefix_caching": False, "skip_tokenizer_init": True})
    from transformers import AutoModelForCausalLM  # deferred: transformers is slow to import

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    tokenizer = load_tokenizer(str(path))
    tokenizer.eos_token = None  # a random model's draw of the end-of-text id must not end a timed row
    lm = LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec=str(path))
    if engine in MASKED_ENGINES:
        heads = masked_heads(lm.geometry.n_layers, lm.geometry.n_heads, mask_heads)
        backend = KeyMaskedHFBackend(lm, decoding, heads, {})
        if engine == "hf_masked_eager":
            model.generation_config.disable_compile = True
    else:
        backend = HFBackend(lm, decoding)
    backend.engine_start_s = time.perf_counter() - start
    return backend


def measure(backend, texts: list[str], seeds: list[int], engine: str) -> tuple[float, int]:
    """Seconds for one ``generate_many`` of ``texts`` and the tokens it generated."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    if engine == "vllm":
        ids = [backend.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        gens = backend.generate_ids(ids, seeds, ignore_eos=True)
    else:
        gens = backend.generate_many(list(zip(texts, seeds, strict=True)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(g.n_tokens for g in gens)


def check_compiled_mask(tokenizer_source: str, device: str) -> dict:
    """Whether the compiled key-masked decode step draws the uncompiled one's tokens: a 2-layer random
    Qwen3 in float32 with SDPA attention (the masked path's), untied output layer and wide weights
    (initializer range 0.2: a tied one repeats a token whatever it reads), 4 prompts of 200
    placeholder tokens, greedy, 12 new tokens, every head kept from most of each prompt, under two
    masks in a row through one model (the second call reuses the compiled step; one of its rows
    hides nothing).
    On a CPU the compiled side is dynamo's trace run eagerly (no C++ toolchain needed). Records rows
    agreeing, rows compared, and rows the mask changed against the unmasked generation."""
    from transformers import AutoModelForCausalLM, CompileConfig, Qwen3Config  # deferred: slow to import

    cfg = Qwen3Config(**{**SMOKE_ARCH, "tie_word_embeddings": False}, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    tokenizer = padded_tokenizer(tokenizer_source, cfg.vocab_size)
    lm = LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec="check")
    texts = prompts(tokenizer, 4, 200, base_vocab(tokenizer_source), cfg.vocab_size, seed=7)
    items = [(t, i) for i, t in enumerate(texts)]
    heads = list(range(cfg.num_hidden_layers * cfg.num_attention_heads))
    decoding = DecodingConfig(max_new_tokens=12)
    compiled = None
    if device == "cpu":
        compiled = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
        compiled._compile_all_devices = True
    agree = changed = rows = 0
    second = [tuple(range(20, 200)), tuple(range(0, 120)), (), tuple(range(0, 200, 2))]
    for spans in ([tuple(range(0, 190))] * 4, second):
        masks = [list(x) for x in spans]
        model.generation_config.disable_compile = True
        eager = generate_hf_many(lm, items, decoding, greedy=True, key_masks=masks, mask_heads=heads, batch_size=4)
        clean = generate_hf_many(lm, items, decoding, greedy=True, batch_size=4)
        model.generation_config.disable_compile = False
        fast = generate_hf_many(lm, items, decoding, greedy=True, key_masks=masks, mask_heads=heads, batch_size=4,
                                compile_config=compiled)
        rows += len(items)
        agree += sum(a.token_ids == b.token_ids for a, b in zip(eager, fast, strict=True))
        changed += sum(a.token_ids != b.token_ids for a, b in zip(eager, clean, strict=True))
    return {"mask_check.rows": rows, "mask_check.agree": agree, "mask_check.changed_by_mask": changed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="vllm",
                    help="vllm, hf_batched, hf_masked or hf_masked_eager; several comma-separated run one after "
                         "another on one saved model")
    ap.add_argument("--model", default="qwen3-4b", choices=(*sorted(ARCHS), "smollm3-3b"))
    ap.add_argument("--prompt", type=int, default=36000, help="prompt tokens")
    ap.add_argument("--runs", nargs="+", default=["1x256", "16x256", "16x6000", "1x6000"],
                    help="<batch>x<new tokens>, timed in this order ('none' with --check-mask: the check alone)")
    ap.add_argument("--tokenizer", default="carry/smollm2-tokenizer", help="a tokenizer directory or 'embedded'")
    ap.add_argument("--model-root", default="/root/bench-models")
    ap.add_argument("--mask-heads", type=int, default=40, help="hf_masked: heads under the key mask")
    ap.add_argument("--mask-span", type=int, default=64, help="hf_masked: prompt positions they may not read")
    ap.add_argument("--warmup", action="store_true",
                    help="run the largest batch x new tokens once, untimed, before the timed runs")
    ap.add_argument("--check-mask", action="store_true",
                    help="first check that the compiled key-masked step draws the uncompiled one's tokens "
                         "(a small float32 model; see check_compiled_mask)")
    ap.add_argument("--out", default="bench_sampling.json")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model on the CPU through the HF paths (batched, key-masked, and key-masked "
                         "uncompiled), with a warm-up: seconds")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    engines = args.engine.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        ap.error(f"unknown engine {', '.join(unknown)}")
    if args.smoke:
        engines, args.model, args.prompt, args.runs, args.tokenizer = ["hf_batched", *MASKED_ENGINES], "smoke", 24, \
            ["1x4", "3x4"], "embedded"
        args.mask_heads, args.mask_span, args.warmup, args.check_mask = 3, 6, True, True
        args.model_root = tempfile.mkdtemp(prefix="bench-sampling-")
    checked = check_compiled_mask(args.tokenizer, device) if args.check_mask else {}
    if checked:
        print(f"compiled key mask: {checked['mask_check.agree']} of {checked['mask_check.rows']} rows agree, "
              f"{checked['mask_check.changed_by_mask']} changed by the mask", flush=True)
    if checked and args.runs == ["none"]:  # the check alone
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                                              "torch": torch.__version__, **checked}, indent=2))
        return
    runs = [tuple(int(x) for x in r.split("x")) for r in args.runs]
    max_new = max(n for _, n in runs)
    max_len = args.prompt + max_new + 64
    path = model_dir(args.model, Path(args.model_root), max_len, args.tokenizer, device)
    tokenizer = load_tokenizer(str(path))
    base = base_vocab(args.tokenizer)
    vocab = len(tokenizer)
    res: dict = {"card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu-smoke", "torch": torch.__version__,
                 "engine": ",".join(engines), "model": args.model, **checked}
    if set(MASKED_ENGINES) & set(engines):
        res["mask_heads"], res["mask_span"] = args.mask_heads, args.mask_span
    if "vllm" in engines:
        import vllm  # deferred: vLLM is optional

        res["vllm"] = vllm.__version__
        res["env"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))

    def run(backend, engine: str, batch: int, new: int, seed: int) -> tuple[float, int]:
        """One timed call of ``batch`` fresh prompts (drawn with ``seed``) generating ``new`` tokens."""
        backend.decoding = DecodingConfig(max_new_tokens=new)
        texts = prompts(tokenizer, batch, args.prompt, base, vocab, seed=seed)
        if engine in MASKED_ENGINES:
            backend.key_masks = {text: span(args.prompt, args.mask_span) for text in texts}
        return measure(backend, texts, list(range(batch)), engine)

    for engine in engines:
        prefix = f"{engine}.{args.model}.p{args.prompt}"
        with open_backend(engine, path, DecodingConfig(max_new_tokens=max_new), max_len, device,
                          mask_heads=args.mask_heads) as backend:
            res[f"{prefix}.engine_start_s"] = backend.engine_start_s
            print(f"{engine} {args.model}: engine up in {backend.engine_start_s:.1f} s", flush=True)
            if args.warmup:
                batch, new = max(runs, key=lambda r: (r[1], r[0]))
                res[f"{prefix}.warmup_s"], _ = run(backend, engine, batch, new, seed=999_999)
                print(f"warm-up {batch}x{new}: {res[f'{prefix}.warmup_s']:.2f} s", flush=True)
            for i, (batch, new) in enumerate(runs):
                wall, tokens = run(backend, engine, batch, new, seed=1000 * i)
                key = f"{prefix}.b{batch}.n{new}"
                res[f"{key}.wall_s"], res[f"{key}.tokens"] = wall, tokens
                res[f"{key}.per_token_s"] = wall / tokens
                if device == "cuda":
                    res[f"{prefix}.used_gib"] = max(res.get(f"{prefix}.used_gib", 0.0), used_gib())
                print(f"{key}: {wall:.2f} s, {tokens} tokens, {1000 * wall / tokens:.2f} ms/token", flush=True)
                assert tokens == batch * new, f"{tokens} tokens generated, {batch * new} asked for"
                save()
    print(json.dumps(res, indent=2))
    save()


if __name__ == "__main__":
    main()
