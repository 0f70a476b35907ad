"""Every stage refuses what cannot be valid before any MLflow run exists.

Values are refused when the config is built (``Config.validate`` through ``__post_init__``), by
direct construction, ``from_dict`` (the command line) and ``replace`` alike, each error naming
its field. A split that matches no note and a device this machine lacks are refused by the stage
before its run starts: the tracking server holds exactly the runs it held before the call.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.distill.arms import arm_names, resolve_arm
from mistill.errors import MistillInputError
from mistill.stages.characterize import AttributeConfig, EventsConfig, KnockinStageConfig, run_events
from mistill.stages.distill import TargetsConfig, TrainStageConfig, run_targets
from mistill.stages.evaluate import EvaluateConfig, run_evaluate
from mistill.stages.generate import GenerateConfig, run_generate
from mistill.stages.las import LasSimulatorConfig, run_las_simulator
from mistill.stages.mlproject import _default
from mistill.stages.own_heads import OwnHeadsConfig, run_own_heads
from mistill.stages.prepare import PrepareConfig, run_prepare
from mistill.stages.registry import stages
from mistill.stages.report import ReportConfig
from mistill.stages.select_lambda import SelectLambdaConfig
from mistill.stages.shortlist import ShortlistConfig, run_shortlist
from mistill.stages.workflow import CharacterizeConfig, PipelineConfig, pipeline_steps, run_characterize
from stage_fixtures import TINY, now_ms, runs_started_since, unique

REFUSED = [
    (EventsConfig, {"max_notes": -1}, "max_notes"),
    (EventsConfig, {"n_null": -1}, "n_null"),
    (EventsConfig, {"null_min_distance": -1}, "null_min_distance"),
    (EventsConfig, {"p2c_cap": 3}, "p2c_cap"),
    (EventsConfig, {"seed": -1}, "seed"),
    (EventsConfig, {"dtype": "float8"}, "dtype"),
    (EventsConfig, {"model": ""}, "model"),
    (EventsConfig, {"chunk_size": 0}, "chunk_size"),
    (AttributeConfig, {"null_exact_fraction": 1.5}, "null_exact_fraction"),
    (AttributeConfig, {"fdr_q": 0.0}, "fdr_q"),
    (AttributeConfig, {"fdr_q": math.nan}, "fdr_q"),
    (AttributeConfig, {"top_nominees": -1}, "top_nominees"),
    (AttributeConfig, {"stability_splits": 0}, "stability_splits"),
    (AttributeConfig, {"pool_k": 0}, "pool_k"),
    (AttributeConfig, {"grad_batch": 0}, "grad_batch"),
    (KnockinStageConfig, {"k_bins": (0, 8)}, "k_bins"),
    (KnockinStageConfig, {"k_bins": ()}, "k_bins"),
    (KnockinStageConfig, {"k_bins": (8, 8)}, "k_bins"),
    (KnockinStageConfig, {"sets": ("global", "best")}, "sets"),
    (KnockinStageConfig, {"range_gate": -1.0}, "range_gate"),
    (KnockinStageConfig, {"events_per_phase": -1}, "events_per_phase"),
    (TargetsConfig, {"top_k": 0}, "top_k"),
    (TargetsConfig, {"pool_k": 0}, "pool_k"),
    (TargetsConfig, {"window": -1}, "window"),
    (TrainStageConfig, {"overrides": "lambda_p1=-1"}, "lambda_p1"),
    (TrainStageConfig, {"overrides": "lambda_p2=-0.5"}, "lambda_p2"),
    (TrainStageConfig, {"overrides": "pool_k=0"}, "pool_k"),
    (TrainStageConfig, {"overrides": "lambda_p1"}, "overrides"),
    (TrainStageConfig, {"precision": "fp16"}, "precision"),
    (TrainStageConfig, {"arm": "../../etc/x"}, "arm"),
    (TrainStageConfig, {"arm": "/etc/passwd"}, "arm"),
    (TrainStageConfig, {"arm": "../arms/mistill"}, "arm"),
    (TrainStageConfig, {"lr": 0.0}, "lr"),
    (TrainStageConfig, {"lr": math.inf}, "lr"),
    (TrainStageConfig, {"epochs": 0}, "epochs"),
    (TrainStageConfig, {"warmup_frac": 1.5}, "warmup_frac"),
    (TrainStageConfig, {"grad_accum": 0}, "grad_accum"),
    (TrainStageConfig, {"clip": 0.0}, "clip"),
    (TrainStageConfig, {"max_steps": -1}, "max_steps"),
    (TrainStageConfig, {"seed": -2}, "seed"),
    (EvaluateConfig, {"max_notes": -1}, "max_notes"),
    (EvaluateConfig, {"temperature": 0.0}, "temperature"),
    (EvaluateConfig, {"top_p": 0.0}, "top_p"),
    (EvaluateConfig, {"top_p": 1.5}, "top_p"),
    (EvaluateConfig, {"top_k": -1}, "top_k"),
    (EvaluateConfig, {"backend": "onnx"}, "backend"),
    (EvaluateConfig, {"max_new_tokens": 0}, "max_new_tokens"),
    (GenerateConfig, {"max_notes": -3}, "max_notes"),
    (GenerateConfig, {"temperature": -0.1}, "temperature"),
    (GenerateConfig, {"batch_size": -1}, "batch_size"),
    (LasSimulatorConfig, {"max_steps": 0}, "max_steps"),
    (LasSimulatorConfig, {"max_answer_tokens": 3}, "max_answer_tokens"),
    (LasSimulatorConfig, {"lr": -1e-4}, "lr"),
    (LasSimulatorConfig, {"split": ""}, "split"),
    (LasSimulatorConfig, {"max_val_notes": -1}, "max_val_notes"),
    (LasSimulatorConfig, {"max_note_words": -1}, "max_note_words"),
    (OwnHeadsConfig, {"k": (0, 8)}, "k"),
    (OwnHeadsConfig, {"k": ()}, "k"),
    (OwnHeadsConfig, {"n_random": 0}, "n_random"),
    (OwnHeadsConfig, {"m2_k": 0}, "m2_k"),
    (OwnHeadsConfig, {"necessity_k": 0}, "necessity_k"),
    (OwnHeadsConfig, {"n_null": -1}, "n_null"),
    (OwnHeadsConfig, {"max_notes": -1}, "max_notes"),
    (OwnHeadsConfig, {"launch": "ssh"}, "launch"),
    (ReportConfig, {"bootstrap": 0}, "bootstrap"),
    (ReportConfig, {"corpus_bootstrap": 0}, "corpus_bootstrap"),
    (ReportConfig, {"reference_arm": ""}, "reference_arm"),
    (ReportConfig, {"seed": -1}, "seed"),
    (ShortlistConfig, {"device": "tpu"}, "device"),
    (ShortlistConfig, {"rrf_k": -1.0}, "rrf_k"),
    (ShortlistConfig, {"fusion_weight": 1.5}, "fusion_weight"),
    (ShortlistConfig, {"l2": -1.0}, "l2"),
    (ShortlistConfig, {"epochs": 0}, "epochs"),
    (ShortlistConfig, {"train_seed": -1}, "train_seed"),
    (CharacterizeConfig, {"max_notes": -1}, "max_notes"),
    (CharacterizeConfig, {"n_null": -1}, "n_null"),
    (CharacterizeConfig, {"k_bins": (3, 3)}, "k_bins"),
    (CharacterizeConfig, {"device": "gpu"}, "device"),
    (CharacterizeConfig, {"launch": "ssh"}, "launch"),
    (PipelineConfig, {"n_notes": 0}, "n_notes"),
    (PipelineConfig, {"n_null": -1}, "n_null"),
    (PipelineConfig, {"range_gate": -0.5}, "range_gate"),
    (PipelineConfig, {"train_arms": ("../../etc/x",)}, "train_arms"),
    (PipelineConfig, {"train_arms": ("no-such-arm",)}, "train_arms"),
    (PipelineConfig, {"train_grad_accum": 0}, "train_grad_accum"),
    (PipelineConfig, {"las_max_steps": 0}, "las_max_steps"),
    (PipelineConfig, {"eval_max_new_tokens": 0}, "eval_max_new_tokens"),
]


@pytest.mark.parametrize("cls,kwargs,field", REFUSED,
                         ids=[f"{c.__name__}-{'-'.join(map(str, k.values()))}" for c, k, _ in REFUSED])
def test_refused_values_name_their_field(cls, kwargs, field):
    """Built directly, from the command line's strings, or by replacing a valid config."""
    builds = {"direct": lambda: cls(**kwargs),
              "from_dict": lambda: cls.from_dict({k: _default(v) for k, v in kwargs.items()}),
              "replace": lambda: cls().replace(**kwargs)}
    for how, build in builds.items():
        with pytest.raises(MistillInputError) as err:
            build()
        assert err.value.field == field, (how, str(err.value))


def _config_classes() -> list[type[Config]]:
    out, todo = [], list(Config.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def test_every_construction_validates_and_defaults_are_valid():
    stages()  # imports every stage module, so every config class below is loaded
    for cls in _config_classes():
        # a subclass's own __post_init__ would skip (or have to repeat) the base's validation
        assert "__post_init__" not in vars(cls), cls
        assert cls.__post_init__ is Config.__post_init__, cls
    for stage in stages().values():
        cfg = stage.config()  # the defaults MLproject publishes are valid
        assert stage.config.from_dict({k: _default(v) for k, v in cfg.to_dict().items()}) == cfg
    for name in arm_names():
        resolve_arm(name)


@pytest.mark.parametrize("device", ["gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", " cpu", "cuda0", "tpu"])
def test_unknown_device_names_the_accepted_forms(device):
    with pytest.raises(MistillInputError) as err:
        EventsConfig(device=device)
    assert err.value.field == "device"
    for form in ("'cpu'", "'cuda'", "'cuda:<n>'", "'mps'"):
        assert form in str(err.value)
    assert EventsConfig(device="cpu").device == "cpu"
    assert ShortlistConfig(device="auto").device == "auto"  # the encoder's own extra form


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused_when_the_stage_starts(device):
    cfg = EvaluateConfig(device=device)  # readable anywhere: a finished GPU run can be compared
    with pytest.raises(MistillInputError, match="CUDA is not available") as err:
        cfg.check_environment()
    assert err.value.field == "device"


def test_cuda_index_beyond_the_machines_devices_is_refused():
    with pytest.raises(MistillInputError) as err:
        AttributeConfig(device=f"cuda:{torch.cuda.device_count()}").check_environment()
    assert err.value.field == "device"


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_without_mps_is_refused():
    with pytest.raises(MistillInputError, match="not available") as err:
        TargetsConfig(device="mps").check_environment()
    assert err.value.field == "device"


def test_files_named_by_path_join_the_pipelines_identity(tmp_path):
    lock, codes, notes = tmp_path / "lock.yaml", tmp_path / "codes.txt", tmp_path / "notes.jsonl"
    lock.write_text("study: a\n")
    codes.write_text("A00.0\n")
    notes.write_text("{}\n")  # only its bytes matter here: the config never parses it
    arm = tmp_path / "my-arm.yaml"
    arm.write_text("base: mistill\nlambda_p1: 0.05\n")
    cfg = PipelineConfig(corpus=str(notes), select_lock=str(lock), codes_file=str(codes),
                         train_arms=(str(arm), "mistill"))
    digests = cfg.content_digests()
    assert digests["select_lock"] == hashlib.sha256(b"study: a\n").hexdigest()
    assert digests["codes_file"] == hashlib.sha256(b"A00.0\n").hexdigest()
    assert digests["corpus"] == hashlib.sha256(b"{}\n").hexdigest()
    before = digests["train_arms"]
    arm.write_text("base: mistill\nlambda_p1: 0.06\n")
    assert cfg.content_digests()["train_arms"] != before
    assert "train_arms" not in cfg.replace(train_arms=("mistill",)).content_digests()


# --------------------------------------------------------------------- refused before the run
def _refused_without_a_run(call, field: str, *needles: str) -> MistillInputError:
    since = now_ms()
    before = runs_started_since(since)
    with pytest.raises(MistillInputError) as err:
        call()
    assert err.value.field == field, str(err.value)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert runs_started_since(since) == before, "the refused call left a run on the server"
    return err.value


SPLITS = ("'train'", "'val'", "'test'")
"""How the error lists the corpus's splits (4 synthetic notes: 2 train, 1 val, 1 test)."""


@pytest.fixture(scope="module")
def prepared(tracking_uri, tmp_path_factory):
    """A prepared synthetic corpus of 4 notes (tiny model's tokenizer) and the local root."""
    root = tmp_path_factory.mktemp("validation-root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MISTILL_ROOT", str(root))
        run_id = run_prepare(PrepareConfig(corpus="synthetic", corpus_name=unique("val"), n_notes=4, model=TINY))
    return {"run": run_id, "root": root}


@pytest.fixture
def root(prepared, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(prepared["root"]))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    return prepared["root"]


def test_split_without_notes_is_refused_before_any_run(prepared, root):
    prep = prepared["run"]
    cases = {
        "events": (lambda: run_events(EventsConfig(prepare_run=prep, model=TINY, split="nope")), "split"),
        "generate": (lambda: run_generate(GenerateConfig(prepare_run=prep, model=TINY, split="nope",
                                                         max_new_tokens=4)), "split"),
        "evaluate": (lambda: run_evaluate(EvaluateConfig(prepare_run=prep, model=TINY, split="nope",
                                                         max_new_tokens=4)), "split"),
        "las_simulator": (lambda: run_las_simulator(LasSimulatorConfig(prepare_run=prep, model=TINY,
                                                                       split="nope")), "split"),
        "own_heads test": (lambda: run_own_heads(OwnHeadsConfig(prepare_run=prep, model=TINY, test_split="nope",
                                                                launch="inline")), "test_split"),
        "own_heads rank": (lambda: run_own_heads(OwnHeadsConfig(prepare_run=prep, model=TINY, rank_split="nope",
                                                                launch="inline")), "rank_split"),
        "characterize": (lambda: run_characterize(CharacterizeConfig(prepare_run=prep, model=TINY, split="nope",
                                                                     launch="inline")), "split"),
        "shortlist": (lambda: run_shortlist(ShortlistConfig(prepare_run=prep, train_prepare_run=prep,
                                                            train_split="nope")), "train_split"),
    }
    for name, (call, field) in cases.items():
        err = _refused_without_a_run(call, field, "'nope'", *SPLITS)
        assert prep in str(err), name


def test_targets_split_without_notes_is_refused_before_any_run(prepared, root):
    from mistill.stages.characterize import run_attribute

    ev = run_events(EventsConfig(prepare_run=prepared["run"], model=TINY, split="train", max_notes=1, n_null=4))
    att = run_attribute(AttributeConfig(events_run=ev, stability_splits=5))
    _refused_without_a_run(lambda: run_targets(TargetsConfig(teacher_attribute_run=att, split="nope")),
                           "split", "'nope'", *SPLITS)


@pytest.mark.parametrize("stage,argv", [
    ("events", ["--model", TINY]),
    ("evaluate", ["--model", TINY, "--max_new_tokens", "4"]),
    ("generate", ["--model", TINY, "--max_new_tokens", "4"]),
    ("las_simulator", ["--model", TINY]),
    ("own_heads", ["--model", TINY, "--launch", "inline"]),
    ("characterize", ["--model", TINY, "--launch", "inline"]),
])
def test_bad_device_on_the_command_line_exits_2_without_a_run(stage, argv, prepared, root, capsys):
    from mistill.stages.cli import main

    since = now_ms()
    before = runs_started_since(since)
    with pytest.raises(SystemExit) as exc:
        main(stage, ["--prepare_run", prepared["run"], "--device", "gpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "field 'device'" in err and "'cuda:<n>'" in err, err
    assert runs_started_since(since) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it_exits_2_without_a_run(prepared, root, capsys):
    from mistill.stages.cli import main

    since = now_ms()
    before = runs_started_since(since)
    with pytest.raises(SystemExit) as exc:
        main("events", ["--prepare_run", prepared["run"], "--model", TINY, "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert runs_started_since(since) == before


def test_pipeline_refuses_a_split_without_notes_before_any_model_step(tracking_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    name = unique("val-pipe")
    cfg = PipelineConfig(corpus="synthetic", corpus_name=name, n_notes=4, model=TINY, student=TINY, las_model=TINY,
                         train_arms=("vanilla-bf16",), shortlist=False, select_lock="", own_heads=False,
                         report=False, eval_split="nope", launch="inline")
    since = now_ms()
    before = runs_started_since(since)
    with pytest.raises(MistillInputError) as err:
        pipeline_steps(cfg)
    assert err.value.field == "eval_split"
    assert "'nope'" in str(err.value) and all(s in str(err.value) for s in SPLITS)
    client = MlflowClient()
    new = [client.get_run(r) for r in runs_started_since(since) - before]
    assert [r.data.tags.get("mistill.stage") for r in new] == ["prepare"]  # no model step ran


# ----------------------------------------------------------- string parameters are never text
SENTENCE = "the quiet heron counted eleven copper lanterns beside the orchard"
"""Ten words, as a note would hold them."""
TEXT_FORMS = {"spaced": SENTENCE, "path": f"/data/{SENTENCE}.jsonl", "hyphenated": SENTENCE.replace(" ", "-"),
              "lines": "heron\nlanterns"}
"""The sentence as plain words, as a file path, joined into one token, and text over two lines."""


def _string_fields() -> list[tuple[str, str, bool]]:
    """(stage, field, is a tuple) for every ``str`` and ``tuple[str, ...]`` field of every stage
    config in the registry."""
    import dataclasses
    import typing

    out = []
    for stage in stages().values():
        hints = typing.get_type_hints(stage.config)
        for f in dataclasses.fields(stage.config):
            if hints[f.name] in (str, tuple[str, ...]):
                out.append((stage.name, f.name, hints[f.name] is not str))
    return out


STRING_FIELDS = _string_fields()


@pytest.mark.parametrize("stage,field,is_tuple", STRING_FIELDS, ids=[f"{s}-{f}" for s, f, _ in STRING_FIELDS])
def test_no_string_parameter_takes_a_sentence(stage, field, is_tuple):
    """From the command line (as ``mlflow run -P`` passes it) and built directly, each form of the
    sentence is refused as text, naming the field and never repeating the text."""
    from mistill.validation import TextValueError

    cls = stages()[stage].config
    for form, text in TEXT_FORMS.items():
        builds = {"from_dict": lambda: cls.from_dict({field: text}),
                  "direct": lambda: cls(**{field: (text,) if is_tuple else text})}
        for how, build in builds.items():
            with pytest.raises(TextValueError) as err:
                build()
            assert err.value.field == field, (form, how, str(err.value))
            assert "heron" not in str(err.value) and "lanterns" not in str(err.value), (form, how)


def test_string_fields_are_all_covered():
    """The parametrisation above sees every kind of string parameter (guards its own helper)."""
    fields = {(s, f) for s, f, _ in STRING_FIELDS}
    assert {("prepare", "corpus"), ("prepare", "patient_ids"), ("events", "prepare_run"), ("train", "overrides"),
            ("train", "arm"), ("select_lambda", "storage"), ("shortlist", "exclude_prepare_runs"),
            ("report", "arms"), ("pipeline", "train_arms"), ("characterize", "launch")} <= fields
    assert len(fields) >= 80


def test_each_kind_of_string_parameter_accepts_its_forms(tmp_path):
    import uuid

    run_a, run_b = uuid.uuid4().hex, uuid.uuid4().hex
    spaced = tmp_path / "my notes" / "corpus v2.jsonl"  # an existing file may have spaces
    spaced.parent.mkdir()
    spaced.write_text("{}\n")
    accepted = [
        EventsConfig(prepare_run=run_a, split="train", model="tiny:qwen3:layers=6:d_model=512"),
        EventsConfig(model="embedded:smollm2-135m@every-other"),
        EventsConfig(model=f"run:{run_a}@layers=0,2"),
        EventsConfig(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),  # a hub id in the HF cache
        EventsConfig(model="/models/qwen3::Qwen3-14B-Q4_K_M.gguf"),
        PrepareConfig(corpus="mimic:/data/mimiciv_icd10.feather", split_file="/data/splits.csv",
                      codes_file="~/codes/icd10.txt", corpus_name="mimic4-icd10", select_split="train",
                      select_n=10, patient_ids="clear"),
        PrepareConfig(corpus=str(spaced), corpus_name="spaced"),
        TrainStageConfig(targets_run=run_a, arm="vanilla-bf16", precision="fp32",
                         overrides="lambda_p1=0.03,terms=attention+write,pool_k=8"),
        ReportConfig(corpus="mimic4-icd10", arms=("vanilla-bf16", "mistill"), reference_arm="mistill"),
        SelectLambdaConfig(storage="postgresql://user@db.example/optuna", corpus_name="c-1", prepare_run=run_b),
        ShortlistConfig(exclude_prepare_runs=(run_a, run_b), encoder="embedded:all-minilm-l6-v2", val_split=""),
        EvaluateConfig(train_run=run_a, las_run=run_b, arm="teacher", split=""),
    ]
    for cfg in accepted:  # and the same values as the command line gives them
        assert type(cfg).from_dict({k: _default(v) for k, v in cfg.to_dict().items()}) == cfg


@pytest.mark.parametrize("cls,kwargs,field", [
    (EventsConfig, {"prepare_run": "x"}, "prepare_run"),
    (EventsConfig, {"prepare_run": "0123456789ABCDEF0123456789ABCDEF"}, "prepare_run"),
    (ShortlistConfig, {"exclude_prepare_runs": ("",)}, "exclude_prepare_runs"),
    (EventsConfig, {"split": ".hidden"}, "split"),
    (EventsConfig, {"split": "s" * 65}, "split"),
    (EventsConfig, {"model": "run:abc"}, "model"),
    (EventsConfig, {"model": "tiny:qwen3:layers"}, "model"),
    (EventsConfig, {"model": "embedded:smollm2-135m@every-third"}, "model"),
    (EventsConfig, {"model": "/data/my notes/model"}, "model"),
    (PrepareConfig, {"corpus": "/data/my notes/x.jsonl"}, "corpus"),
    (PrepareConfig, {"patient_ids": "hidden"}, "patient_ids"),
    (TrainStageConfig, {"overrides": "lambda_p1=0.03,no_such_flag=1"}, "overrides"),
    (TrainStageConfig, {"overrides": "terms=attention write"}, "overrides"),
    (SelectLambdaConfig, {"storage": "selection.db"}, "storage"),
    (SelectLambdaConfig, {"launch": "ssh"}, "launch"),
    (ReportConfig, {"arms": ("../x",)}, "arms"),
])
def test_each_kind_of_string_parameter_refuses_other_forms(cls, kwargs, field):
    with pytest.raises(MistillInputError) as err:
        cls(**kwargs)
    assert err.value.field == field, str(err.value)


def test_text_on_the_command_line_exits_2_without_repeating_it(capsys, monkeypatch, tmp_path):
    from mistill.stages.cli import main

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MISTILL_ROOT", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        main("prepare", ["--select_split", SENTENCE, "--select_n", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "field 'select_split'" in err and "10 words" in err
    assert "heron" not in err
