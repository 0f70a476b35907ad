"""Device benchmark of the two steps the runbook could not cost: the retriever (``shortlist``) and
the LAS simulator (``las_simulator``, and its predictions inside ``evaluate``).

Both run the stages' own code on random-init real architectures built from their configs:

- **retriever** (App. A): a gte-large-shaped BERT encoder (24 layers, hidden 1024, 16 heads, a
  512-token window, fp32 as :func:`mistill.models.encoder.load_encoder` loads it) written once to
  ``--model-root`` with a BERT uncased tokenizer, read through :class:`mistill.data.shortlist.
  Retriever`: the code descriptions of a ``--codes``-code inventory, then ``features`` of
  ``--notes`` synthetic notes of ``--note-words`` words (chunks of ``chunk_words`` words, each
  note's chunks encoded together), then :func:`mistill.models.linear_head.train_linear_head`
  (on the host CPU, as the stage runs it) for ``--head-epochs`` epochs on ``--head-notes``
  notes' pooled features. Records seconds per note (``shortlist.note_s``), per description
  (``shortlist.description_s``) and per note and head epoch (``shortlist.head_note_epoch_s``),
  with the tokens a chunk took.
- **LAS simulator** (App. K): Qwen3-1.7B (28 layers, hidden 2048, 16 heads, 8 key-value heads) in
  bf16, :func:`mistill.evaluation.las.train_simulator` steps on pairs of sequences of
  ``--las-tokens`` (note + rationale + answer) and ``--las-note-tokens`` (note + answer) ids, then
  :func:`mistill.evaluation.las.greedy_answer` on a prompt of each length and
  :func:`~mistill.evaluation.las.greedy_answers` on ``--las-batch`` of them, forced to
  ``--answer-tokens`` tokens (a random model writes no JSON list to stop at). Records
  ``las.step_s``, ``las.predict_rationale_s`` / ``las.predict_note_s`` (one prompt) and
  ``las.predict_rationale_batch_s`` / ``las.predict_note_batch_s`` (one batch).

Usage (on the GPU machine; ``benchmarks/stage.sh`` writes ``carry/``):
    python3 benchmarks/bench_shortlist_las.py --tokenizer carry/minilm-tokenizer \\
        --las-tokenizer carry/smollm2-tokenizer --out raw.json
    python3 benchmarks/bench_shortlist_las.py --smoke      # tiny models on the CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sampling import padded_tokenizer, prompts  # noqa: E402

from mistill.data.corpus import Note  # noqa: E402
from mistill.data.inventory import Inventory  # noqa: E402
from mistill.data.shortlist import Retriever, RetrieverSettings  # noqa: E402
from mistill.evaluation.las import IGNORE_INDEX, Encoded, greedy_answer, greedy_answers, train_simulator  # noqa: E402
from mistill.models.encoder import EMBEDDED_ENCODER, encoder_dir as embedded_encoder_dir, load_encoder  # noqa: E402
from mistill.models.linear_head import train_linear_head  # noqa: E402

GTE_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                 max_position_embeddings=512, vocab_size=30522)
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
SMOKE_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=512, vocab_size=30522)
SMOKE_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=49152 + 64, tie_word_embeddings=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_encoder_dir(root: Path, arch: dict, tokenizer_source: str) -> Path:
    """A sentence-encoder directory: a random-init BERT of ``arch`` and the BERT uncased tokenizer
    at ``tokenizer_source`` (``embedded``: the embedded MiniLM's), mean pooling, 512 tokens."""
    from transformers import AutoTokenizer, BertConfig, BertModel  # deferred: transformers is slow to import

    path = root / "encoder"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    BertModel(BertConfig(**arch)).save_pretrained(path)
    if tokenizer_source == "embedded":
        tokenizer_source = str(embedded_encoder_dir(EMBEDDED_ENCODER))
    AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return path


def synthetic_words(tokenizer, n: int, seed: int) -> list[str]:
    """``n`` whole words of the tokenizer's vocabulary (alphabetic, no word pieces)."""
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    g = torch.Generator().manual_seed(seed)
    return [vocab[int(i)] for i in torch.randint(0, len(vocab), (n,), generator=g)]


def bench_retriever(args, device: str, res: dict) -> None:
    arch = SMOKE_ENCODER if args.smoke else GTE_LARGE
    path = bench_encoder_dir(Path(args.model_root), arch, args.tokenizer)
    t = time.perf_counter()
    encoder = load_encoder(str(path), device=device)
    res["shortlist.encoder_load_s"] = time.perf_counter() - t
    words = synthetic_words(encoder.tokenizer, args.codes * 8 + args.notes * args.note_words, seed=0)
    codes = tuple(f"C{i:05d}" for i in range(args.codes))
    inventory = Inventory(codes=codes, descriptions={c: " ".join(words[8 * i:8 * i + 8]) for i, c in enumerate(codes)})
    settings = RetrieverSettings()
    sync(device)
    t = time.perf_counter()
    retriever = Retriever(encoder, inventory, settings)
    sync(device)
    res["shortlist.description_s"] = (time.perf_counter() - t) / args.codes
    base = args.codes * 8
    notes = [Note(note_id=f"n{i}", patient_id=f"p{i}", split="train",
                  text=" ".join(words[base + i * args.note_words: base + (i + 1) * args.note_words]),
                  gold_codes=(codes[i % args.codes],)) for i in range(args.notes)]
    chunk = retriever.note_chunks(notes[0])[0]
    res["shortlist.chunk_tokens"] = len(encoder.tokenizer(chunk)["input_ids"])
    res["shortlist.chunks_per_note"] = len(retriever.note_chunks(notes[0]))
    retriever.features(notes[:1])  # warm-up: kernels, allocator
    sync(device)
    t = time.perf_counter()
    x, zero = retriever.features(notes)
    sync(device)
    res["shortlist.note_s"] = (time.perf_counter() - t) / args.notes
    res["shortlist.note_words"] = args.note_words
    assert x.shape == (args.notes, 2 * encoder.dim) and zero.shape == (args.notes, args.codes)
    # the head: pooled features of --head-notes notes (the measured notes' rows repeated), every code
    reps = -(-args.head_notes // args.notes)
    feats = x.repeat(reps, 1)[:args.head_notes] + 1e-3 * torch.randn(args.head_notes, x.shape[1])
    labels = (torch.rand(args.head_notes, args.codes, generator=torch.Generator().manual_seed(1)) < 0.002).float()
    t = time.perf_counter()
    head = train_linear_head(feats, labels, epochs=args.head_epochs, batch_size=settings.head_batch_size)
    res["shortlist.head_note_epoch_s"] = (time.perf_counter() - t) / (args.head_notes * args.head_epochs)
    res["shortlist.head_threads"] = torch.get_num_threads()
    res["shortlist.codes"] = args.codes
    assert head.weight.shape == (args.codes, x.shape[1])
    del encoder, retriever
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bench_las(args, device: str, res: dict) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config  # deferred: transformers is slow to import

    arch = SMOKE_LM if args.smoke else QWEN3_1_7B
    cfg = Qwen3Config(**arch, max_position_embeddings=max(args.las_tokens + args.answer_tokens, 4096),
                      rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if args.smoke else torch.bfloat16)
    model.generation_config.eos_token_id = None
    tokenizer = padded_tokenizer(args.las_tokenizer, cfg.vocab_size)
    g = torch.Generator().manual_seed(2)

    def sequence(length: int) -> Encoded:
        ids = torch.randint(1000, 40000, (length,), generator=g)
        labels = ids.clone()
        labels[: length - args.answer_tokens] = IGNORE_INDEX
        return Encoded(ids, labels)

    pairs = [(sequence(args.las_tokens), sequence(args.las_note_tokens)) for _ in range(args.las_steps + 1)]
    train_simulator(model, pairs[:1], max_steps=1, lr=1e-5, seed=0, progress=False)  # warm-up
    sync(device)
    t = time.perf_counter()
    losses = train_simulator(model, pairs[1:], max_steps=args.las_steps, lr=1e-5, seed=0, progress=False)
    sync(device)
    res["las.step_s"] = (time.perf_counter() - t) / args.las_steps
    res["las.tokens"] = args.las_tokens
    res["las.note_tokens"] = args.las_note_tokens
    res["las.peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if device.startswith("cuda") else float("nan")
    assert len(losses) == args.las_steps
    vocab_from = tokenizer.convert_tokens_to_ids("<|x0|>")  # placeholder tokens: one id each
    for seed, (tag, length) in enumerate((("rationale", args.las_tokens), ("note", args.las_note_tokens))):
        batch = prompts(tokenizer, args.las_batch, length - args.answer_tokens, vocab_from, cfg.vocab_size, seed)
        sync(device)
        t = time.perf_counter()
        greedy_answer(model, tokenizer, batch[0], max_new_tokens=args.answer_tokens)
        sync(device)
        res[f"las.predict_{tag}_s"] = time.perf_counter() - t
        t = time.perf_counter()
        answers = greedy_answers(model, tokenizer, batch, max_new_tokens=args.answer_tokens,
                                 batch_size=args.las_batch)
        sync(device)
        res[f"las.predict_{tag}_batch_s"] = time.perf_counter() - t
        assert len(answers) == args.las_batch
    res["las.predict_batch"] = args.las_batch
    res["las.answer_tokens"] = args.answer_tokens
    res["las.predict_peak_gib"] = (torch.cuda.max_memory_allocated() / 2 ** 30 if device.startswith("cuda")
                                   else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="carry/minilm-tokenizer", help="a BERT uncased tokenizer directory")
    ap.add_argument("--las-tokenizer", default="carry/smollm2-tokenizer")
    ap.add_argument("--model-root", default="/root/bench-models")
    ap.add_argument("--codes", type=int, default=5651, help="the inventory (the paper's diagnosis codes)")
    ap.add_argument("--notes", type=int, default=256)
    ap.add_argument("--note-words", type=int, default=1500)
    ap.add_argument("--head-notes", type=int, default=8192)
    ap.add_argument("--head-epochs", type=int, default=2)
    ap.add_argument("--las-tokens", type=int, default=8192, help="note + rationale + answer")
    ap.add_argument("--las-note-tokens", type=int, default=2048, help="note + answer")
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--las-steps", type=int, default=8)
    ap.add_argument("--las-batch", type=int, default=16, help="prompts per batched prediction (LAS_BATCH)")
    ap.add_argument("--out", default="bench_shortlist_las.json")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: seconds")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    tmp = None
    if args.smoke:
        tmp = tempfile.mkdtemp(prefix="bench-shortlist-las-")
        args.model_root, args.tokenizer, args.las_tokenizer = tmp, "embedded", "embedded"
        args.codes, args.notes, args.note_words, args.head_notes, args.head_epochs = 40, 3, 300, 8, 2
        args.las_tokens, args.las_note_tokens, args.answer_tokens, args.las_steps, args.las_batch = 48, 24, 6, 2, 3
    res: dict = {"card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu-smoke",
                 "torch": torch.__version__}
    try:
        for part in (bench_retriever, bench_las):
            part(args, device, res)
            print(part.__name__, json.dumps({k: v for k, v in res.items() if "." in k}), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
