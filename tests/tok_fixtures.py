"""Tokenizers built in tests: a digit-run-merging one (a SmolLM3-like tokenizer in miniature)."""

from __future__ import annotations

import re
import string


def merging_tokenizer(merged=("18", "28", "65", "95")):
    """Characters are single tokens, uppercase letters also with a leading space, and the digit
    runs ``merged`` are single tokens: an event deciding one character inside them has no
    position of its own."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0}
    pieces = (list(string.ascii_letters + string.digits + string.punctuation)
              + [" " + c for c in string.ascii_uppercase] + [" ", "\n", *merged])
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    runs = "|".join(re.escape(m) for m in merged)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(rf" ?[A-Z]|{runs}|[0-9]|\s|\S"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def bpe_tokenizer(texts: list[str], vocab_size: int = 600, *, all_bytes: bool = False):
    """A byte-level BPE tokenizer trained on ``texts`` (a real vocabulary and merges, EOS
    ``<|endoftext|>``; with ``all_bytes``, every byte is a token, so any text encodes):
    ``(tokenizers.Tokenizer, PreTrainedTokenizerFast)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if all_bytes else []))
    return tok, PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
