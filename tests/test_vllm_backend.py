"""The vLLM backend on the real embedded SmolLM2-135M (float32), through the vLLM build that
scripts/setup.sh installed (the CPU build ``vllm-cpu`` on a machine without CUDA).

Greedy decoding (top-k 1, the arg-max on both backends) gives HF's tokens; the paper's sampling
(temperature 0.6, top-p 0.95, top-k 20) is reproducible per seed; a model's YaRN setting reaches
the engine; and the ``generate`` and ``evaluate`` stages run with ``backend=vllm`` on the test
tracking server: per-note resume after a crash, and the flags, rates and traced corpus as with HF.

These tests run by default: without vLLM they fail (run scripts/setup.sh), unless
``MISTILL_VLLM=0`` says the vLLM lane is off, which skips them. Every engine runs in vLLM's own
worker processes (its default), so this process keeps its torch threads; the module holds at most
one engine at a time and shares it among the backends built with the same engine arguments
(:class:`SharedEngines`), so the stages below reuse the engine the first test started. The KV
cache is 1 GiB (``VLLM_CPU_KVCACHE_SPACE``) unless the environment says otherwise (2 GiB for the
YaRN engine's 32k-token window).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from mistill.data.prompts import build_prompt
from mistill.errors import MistillInputError
from mistill.evaluation.backends import HFBackend, VLLMBackend, make_backend
from mistill.evaluation.generation import DecodingConfig, note_seed
from mistill.models.loading import EMBEDDED_DEFAULT, embedded_float_copy, embedded_tokenizer
from gen_fixtures import scripted_model
from stage_fixtures import TINY, artifact_paths, runs_of, unique

REPO = Path(__file__).resolve().parents[1]
VLLM_OFF = os.environ.get("MISTILL_VLLM", "1") == "0"
GREEDY_TOKENS = 32
INVENTORY = 20
"""Codes in the synthetic inventory: prompts of about 700 tokens."""
SCRIPT_SECRET = "violet stapler hummed softly near eleven quiet dunes"


def _pins(rel: str) -> dict[str, str]:
    out = {}
    for line in (REPO / rel).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
            assert m, f"{rel}: not an exact pin: {line!r}"
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def require_vllm() -> None:
    """Skip under ``MISTILL_VLLM=0``; otherwise vLLM must be installed (the suite runs these)."""
    if VLLM_OFF:
        pytest.skip("MISTILL_VLLM=0: the vLLM lane of scripts/setup.sh is off")
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: run scripts/setup.sh (it installs vLLM's CPU build on a "
                    "machine without CUDA, its CUDA build with a GPU), or set MISTILL_VLLM=0 to leave "
                    "the vLLM tests out", pytrace=False)


# ------------------------------------------------------------------------------ set-up files
def test_setup_installs_the_vllm_lane_without_touching_the_lock():
    """requirements/vllm-cpu.txt pins vllm-cpu and what it needs, none of it a package the lock
    pins (those keep their versions), and none of the CUDA-linked builds; requirements/vllm-cuda.txt
    names the same vLLM release, which the pyproject extra admits; setup.sh installs the CPU file
    with --no-deps, the CUDA one followed by the lock, both under the idempotence stamp, unless
    MISTILL_VLLM=0."""
    lock, cpu, cuda = _pins("requirements/lock.txt"), _pins("requirements/vllm-cpu.txt"), \
        _pins("requirements/vllm-cuda.txt")
    assert set(cpu) & set(lock) == set(), "the CPU lane must not re-pin a locked package"
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(cpu)
    assert list(cuda) == ["vllm"] and cpu["vllm-cpu"] == cuda["vllm"]
    extra = [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())
             ["project"]["optional-dependencies"]["vllm"]]
    assert [r.name for r in extra] == ["vllm"] and extra[0].specifier.contains(Version(cuda["vllm"]))
    text = (REPO / "scripts/setup.sh").read_text(encoding="utf-8")
    assert "VLLM_CPU=requirements/vllm-cpu.txt" in text and "VLLM_CUDA=requirements/vllm-cuda.txt" in text
    assert re.search(r'pip install -q --no-deps -r "\$VLLM_CPU"', text)
    assert re.search(r'pip install -q -r "\$VLLM_CUDA"\n\s*python -m pip install -q -r "\$LOCK"', text)
    stamp = re.search(r"^want=\$\(cat ([^|]*)\|", text, re.M | re.S)
    assert stamp and '"$VLLM_CPU"' in stamp.group(1) and '"$VLLM_CUDA"' in stamp.group(1)
    assert "VLLM_LANE=${MISTILL_VLLM:-1}" in text and '[ "$VLLM_LANE" != 0 ]' in text


def test_installed_vllm_kept_the_locked_versions():
    """vLLM 0.32 declares transformers<5.20, numpy<2.4 (through mistral-common), fastapi<0.137 and
    setuptools==78.1.1: the lane installs it without letting those pins replace the lock's."""
    require_vllm()
    lock = _pins("requirements/lock.txt")
    for name in ("transformers", "numpy", "fastapi", "setuptools", "torch"):
        installed = Version(importlib.metadata.version(name))
        assert installed.public == Version(lock[name]).public, \
            f"{name} {installed} is installed, the lock says {lock[name]}: rerun scripts/setup.sh"


# ---------------------------------------------------------------------------------- engines
class _Deferred:
    """A shared engine's ``engine_core`` as a backend sees it: its ``shutdown`` waits for
    :meth:`SharedEngines.close`, so a stage that frees its backend leaves the engine to the next."""

    def shutdown(self) -> None:
        pass


class _Shared:
    """The shared engine (an ``LLM``, or its ``llm_engine``) with ``engine_core`` deferred."""

    def __init__(self, inner, wrap_engine: bool) -> None:
        self._inner, self._wrap_engine = inner, wrap_engine

    def __getattr__(self, name):
        if self._wrap_engine and name == "llm_engine":
            return _Shared(self._inner.llm_engine, False)
        if not self._wrap_engine and name == "engine_core":
            return _Deferred()
        return getattr(self._inner, name)


class SharedEngines:
    """Stands for ``vllm.LLM`` in this module: builds real engines, keeps one alive, and returns
    it again to every later call with the same keyword arguments (another call shuts it down
    first). A backend's own ``close`` leaves the shared engine running (:class:`_Deferred`).
    ``built``: the keyword arguments of every engine started."""

    def __init__(self, real) -> None:
        self.real = real
        self.kwargs: dict | None = None
        self.llm = None
        self.built: list[dict] = []

    def __call__(self, **kwargs):
        if self.llm is not None and kwargs == self.kwargs:
            return _Shared(self.llm, True)
        self.close()
        self.llm, self.kwargs = self.real(**kwargs), dict(kwargs)
        self.built.append(dict(kwargs))
        return _Shared(self.llm, True)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = self.kwargs = None
            gc.collect()


@pytest.fixture(scope="module")
def engines(tracking_uri):
    """The module's engines; vLLM's changes to this process's environment are undone after."""
    require_vllm()
    import vllm

    saved = dict(os.environ)
    shared = SharedEngines(vllm.LLM)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine in its own processes
        mp.setattr(vllm, "LLM", shared)
        try:
            yield shared
        finally:
            shared.close()
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="module")
def prepared(engines, tmp_path_factory, pinned_code_version):
    """(run id, corpus, prompts): a prepared synthetic corpus of 3 notes (20-code inventory) and
    each note's prompt as the generate stage builds it (the embedded model's chat template)."""
    from mistill.stages.common import load_prepared
    from mistill.stages.prepare import PrepareConfig, run_prepare

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(tmp_path_factory.mktemp("vllm-root")))
        prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("vllm"), n_notes=3,
                                         inventory_size=INVENTORY, model=TINY))
        p = load_prepared(prep)
    tok = embedded_tokenizer()
    prompts = [build_prompt(n, n.shortlist, p.inventory, tok,
                            remove_discharge_diagnosis=p.remove_discharge_diagnosis,
                            narrow_instruction=p.narrow_instruction).text for n in p.corpus.notes]
    return prep, p, prompts


@pytest.fixture(scope="module")
def hf_lm(engines):
    from mistill.models.loading import load_model

    return load_model(EMBEDDED_DEFAULT, dtype="float32")


@pytest.fixture(scope="module")
def hf_greedy(prepared, hf_lm):
    """HF's greedy completion (top-k 1, 32 tokens) of every prompt."""
    dec = DecodingConfig(top_k=1, max_new_tokens=GREEDY_TOKENS)
    return [HFBackend(hf_lm, dec).generate(prompt, 11) for prompt in prepared[2]]


def _vllm(decoding: DecodingConfig, spec: str = EMBEDDED_DEFAULT) -> VLLMBackend:
    backend = make_backend("vllm", spec, decoding, dtype="float32")
    assert isinstance(backend, VLLMBackend)
    return backend


def _top2_gaps(lm, prompt: str, new: list[int]) -> torch.Tensor:
    """HF's top-1 minus top-2 logit at each generated position (teacher-forced), ``[len(new)]``."""
    ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"] + new
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0, len(ids) - len(new) - 1:-1]
    top = logits.float().topk(2).values
    return top[:, 0] - top[:, 1]


# ---------------------------------------------------------------------------------- decoding
@pytest.mark.real_model
def test_greedy_decoding_gives_hf_tokens(engines, prepared, hf_lm, hf_greedy):
    """Top-k 1 is the arg-max on both backends: vLLM's first 32 tokens of every prompt are HF's.
    The prompts have no near-tie in those steps (HF's top-2 gap > 1e-3), so float32 summation
    order cannot excuse a difference."""
    _, _, prompts = prepared
    dec = DecodingConfig(top_k=1, max_new_tokens=GREEDY_TOKENS)
    backend = _vllm(dec)
    # no CUDA: an eager engine (compiling takes minutes on a CPU); with CUDA, vLLM's default
    assert backend.engine_kwargs.get("enforce_eager", False) == (not torch.cuda.is_available())
    got = backend.generate_many([(p, 11) for p in prompts])
    for prompt, g, want in zip(prompts, got, hf_greedy, strict=True):
        assert float(_top2_gaps(hf_lm, prompt, want.token_ids).min()) > 1e-3
        assert g.token_ids == want.token_ids and g.n_tokens == len(want.token_ids) == GREEDY_TOKENS
        assert g.text == want.text and g.capped and want.capped
        assert g.decoding == {**want.decoding, "backend": "vllm"}


@pytest.mark.real_model
def test_sampling_with_the_papers_settings_is_seeded_and_reproducible(engines, prepared):
    """Temperature 0.6, top-p 0.95, top-k 20: the same seeds give the same tokens twice, a note
    alone gives what it gave in the batch, and another seed gives another sample."""
    _, p, prompts = prepared
    dec = DecodingConfig(max_new_tokens=24)
    backend = _vllm(dec)
    items = [(text, note_seed(dec, n.note_id)) for n, text in zip(p.corpus.notes, prompts, strict=True)]
    first, second = backend.generate_many(items), backend.generate_many(items)
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert all(g.n_tokens > 0 for g in first)
    assert backend.generate(*items[-1]).token_ids == first[-1].token_ids
    other = backend.generate_many([(text, seed + 1) for text, seed in items])
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    assert [g.seed for g in first] == [s for _, s in items]
    assert first[0].decoding == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 24,
                                 "seed": 0, "backend": "vllm", "rope_scaling": None}


def test_models_vllm_cannot_serve_are_refused(engines):
    with pytest.raises(MistillInputError, match="cannot be served by vLLM") as err:
        make_backend("vllm", TINY, DecodingConfig())
    assert err.value.field == "model"


# ------------------------------------------------------------------------------------ stages
@pytest.mark.real_model
def test_evaluate_with_vllm_resumes_and_predicts_as_hf(engines, prepared, hf_greedy, tracking_uri,
                                                       tmp_path, monkeypatch, pinned_code_version):
    """An evaluate run interrupted during its third note's readouts resumes without sampling any
    note again or redoing the two written notes; under greedy decoding its predictions (codes,
    flags, token counts) are those of HF's generations."""
    import mistill.stages.evaluate as ev
    from mistill.evaluation.generation import generation_record
    from mistill.tasks import task_for

    prep, p, _ = prepared
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    cfg = ev.EvaluateConfig(prepare_run=prep, model=EMBEDDED_DEFAULT, arm="teacher", split="",
                            backend="vllm", max_new_tokens=GREEDY_TOKENS, top_k=1, fidelity=False)
    sampled: list[int] = []
    real_ids = VLLMBackend.generate_ids

    def counting(self, prompts, seeds, **kwargs):
        sampled.extend(seeds)
        return real_ids(self, prompts, seeds, **kwargs)
    monkeypatch.setattr(VLLMBackend, "generate_ids", counting)
    read: list[str] = []

    def interrupted(note, gen, reader):
        read.append(note.note_id)
        if len(read) == 3:
            raise KeyboardInterrupt("interrupted at the third note")
        return generation_record(note, gen, reader)
    monkeypatch.setattr(ev, "generation_record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ev.run_evaluate(cfg)
    assert len(sampled) == 3  # the three notes in one engine call
    sampled.clear()
    read.clear()
    run_id = ev.run_evaluate(cfg)
    assert sampled == [] and len(read) == 1  # nothing sampled again; only the third note read
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["n_notes"] == 3
    assert len(runs_of(client.get_experiment(run.info.experiment_id).name, stage="evaluate")) == 1

    path = client.download_artifacts(run_id, "predictions.jsonl", str(tmp_path))
    got = [json.loads(line) for line in open(path).read().splitlines()]
    reader = task_for(p.inventory).answer_reader(p.inventory.codes)
    decoding = DecodingConfig(top_k=1, max_new_tokens=GREEDY_TOKENS)
    for pred, note, gen in zip(got, p.corpus.notes, hf_greedy, strict=True):
        want = generation_record(note, gen, reader)
        assert {k: v for k, v in pred.items() if k != "seed"} == \
            {k: want[k] for k in pred if k != "seed"}
        assert pred["seed"] == note_seed(decoding, note.note_id)
    assert run.data.metrics["cap_rate"] == float(np.mean([g.capped for g in hf_greedy]))
    assert run.data.metrics["valid_rate"] == float(np.mean([pr["valid"] for pr in got]))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """(model dir, script, code): the script answers with a code of the 40-code inventory."""
    from mistill.data.synthetic import make_synthetic_corpus

    tok = embedded_tokenizer()
    for code in make_synthetic_corpus(n_notes=1, seed=0, inventory_size=INVENTORY).inventory.codes:
        script = f" {SCRIPT_SECRET}</think>[\"{code}\"]"
        ids = tok(script, add_special_tokens=False)["input_ids"]
        if len(set(ids)) == len(ids):
            path = scripted_model(tmp_path_factory.mktemp("scripted") / "model", script, d_head=64)  # vLLM CPU: 64-wide heads
            return str(path), script, code
    raise AssertionError("no inventory code fits the bigram script")


@pytest.mark.real_model
def test_generate_with_vllm_resumes_and_flags_as_hf(engines, scripted, tracking_uri, tmp_path,
                                                    monkeypatch, pinned_code_version):
    """The generate stage with backend=vllm: a run that crashed during its second note resumes
    under the same id without redoing the first; every generation is valid, parsed, closed and
    traced, as the HF backend gives for the same model; a 3-token cap makes every note capped,
    invalid and degenerate, with no traced corpus."""
    import mistill.stages.generate as generate_stage
    from mistill.stages.common import load_prepared
    from mistill.stages.generate import GenerateConfig, run_generate
    from mistill.stages.prepare import PrepareConfig, run_prepare

    model, script, code = scripted
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path / "root"))
    prep = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("vllm-gen"), n_notes=3,
                                     inventory_size=INVENTORY, model=TINY))
    notes = [n.note_id for n in load_prepared(prep).corpus.notes]
    cfg = GenerateConfig(prepare_run=prep, model=model, backend="vllm", max_new_tokens=64, batch_size=1)
    real = generate_stage.generation_record
    calls = []

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash during the second note")
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_stage, "generation_record", crash_on_second)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_generate(cfg)
    monkeypatch.setattr(generate_stage, "generation_record", real)
    client = MlflowClient()
    exp = f"mistill/{load_prepared(prep).corpus.name}"
    failed = runs_of(exp, stage="generate")
    assert list(failed["status"]) == ["FAILED"]
    run_id = failed["run_id"].iloc[0]
    first = tmp_path / "root" / "work" / run_id / "notes" / notes[0]
    assert (first / "_DONE").is_file() and not (first.parent / notes[1]).exists()
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    assert run_generate(cfg) == run_id  # resumed under the same id
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes  # not redone
    run = client.get_run(run_id)
    m = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags["mistill.generate.backend"] == "vllm"
    assert m["n_notes"] == 3 and m["valid_rate"] == 1.0 and m["cap_rate"] == 0.0
    assert m["degenerate_rate"] == 0.0 and m["parsed_rate"] == 1.0 and m["n_traced_notes"] == 3
    n_script = len(embedded_tokenizer()(script, add_special_tokens=False)["input_ids"])
    assert m["mean_generated_tokens"] == n_script + 1  # the script, then end-of-turn
    assert [n.teacher_trace for n in load_prepared(run_id).corpus.notes] == [script] * 3
    assert {f"notes/{n}/trace.txt" for n in notes} <= artifact_paths(client, run_id)
    assert len(runs_of(exp, stage="generate")) == 1

    hf_id = run_generate(replace(cfg, backend="hf"))
    hf = client.get_run(hf_id).data.metrics
    assert {k: v for k, v in hf.items() if not k.startswith("system/")} == \
        {k: v for k, v in m.items() if not k.startswith("system/")}

    capped = run_generate(replace(cfg, max_new_tokens=3))
    run = client.get_run(capped)
    m = run.data.metrics
    assert m["cap_rate"] == 1.0 and m["valid_rate"] == 0.0 and m["degenerate_rate"] == 1.0
    assert m["reason/capped"] == 3 and m["mean_generated_tokens"] == 3 and m["n_traced_notes"] == 0
    assert run.data.tags["mistill.generate.traced_notes"] == "none"


# ---------------------------------------------------------------------------------------- YaRN
@pytest.mark.real_model
def test_yarn_reaches_the_engine(engines, prepared, hf_greedy, tmp_path, monkeypatch):
    """A model whose config carries YaRN x4 is served under YaRN x4: the engine's model config
    has the same rope parameters and the window four times the native one, and its greedy tokens
    are HF's under the same YaRN setting (which differ from the unscaled model's within 16 tokens
    for one of the prompts). ``close`` shuts the engine down."""
    from mistill.models.loading import load_model

    src = embedded_float_copy()
    yarn_dir = tmp_path / "smollm2-yarn"
    yarn_dir.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (yarn_dir / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    native = int(config["max_position_embeddings"])
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": native,
            "rope_theta": config["rope_parameters"]["rope_theta"]}
    config.update(rope_parameters=yarn, max_position_embeddings=4 * native)
    (yarn_dir / "config.json").write_text(json.dumps(config))

    dec = DecodingConfig(top_k=1, max_new_tokens=16)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # room for one 32k-token sequence
    backend = _vllm(dec, str(yarn_dir))
    engine = backend.llm.llm_engine.model_config
    assert engine.max_model_len == 4 * native and backend.engine_kwargs["max_model_len"] == 4 * native
    rope = getattr(engine.hf_config, "rope_parameters", None) or engine.hf_config.rope_scaling
    assert {k: rope[k] for k in yarn} == yarn
    assert backend.rope_scaling == yarn and backend.engine_kwargs["hf_overrides"]["rope_scaling"] == yarn

    _, _, prompts = prepared
    got = backend.generate_many([(p, 5) for p in prompts])
    assert all(g.decoding["rope_scaling"] == yarn for g in got)
    hf = HFBackend(load_model(str(yarn_dir), dtype="float32"), dec)
    want = [hf.generate(p, 5) for p in prompts]
    assert want[0].decoding["rope_scaling"] == yarn
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.token_ids for g in got] != [w.token_ids[:16] for w in hf_greedy]  # YaRN is in effect

    backend.close()
    assert not hasattr(backend, "llm")
    backend.close()  # idempotent
    engines.close()  # the engine it shut down is not handed out again
    shutil.rmtree(yarn_dir)
