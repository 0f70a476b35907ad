"""The ``flip_test`` stage: the evidence-flip test's behavioural half (App. N.3, R-D33; Table 54).

One checkpoint (a ``train`` run's, or any model standing for an arm such as the teacher) answers
every case of a frozen cohort (``cohort_run``: a ``flip_cohort`` run that wrote its four condition
corpora) ``samples`` times under each condition, through the evaluation's generation path: the
case's prompt as ``evaluate`` builds it, the paper's decoding, every answer of the run in one
batched sampling pass (``backend``; tag ``mistill.backend``). The run joins the cohort's
experiment, where the report finds it. Sample ``k`` of a case is drawn with
one seed in every condition (:func:`mistill.evaluation.flip_test.sample_seed`), so the
conditions are compared at the same sample index.

Each answer is parsed as ``evaluate`` parses it and scored against the case's codes ``A`` and
``B`` (:mod:`mistill.evaluation.flip_test`). Logged: ``flip_samples`` (one row per answer: case,
condition, sample index, seed, validity, whether A and B were emitted, ``v``, the category
``v``), ``flip_cases`` (the per-case readings: ``D``, the follow rates, paired success, the
control statistics, invalid outputs, the decomposition, ``D_category``) and, as metrics, their
means over cases (``flip/D``, ``flip/D_lo``, ``flip/D_hi``, ...) with ``flip/n_cases``. The report
sets the checkpoints side by side and reads the seed-pair contrasts (Table 54).

Only codes, flags and ids reach MLflow. The generations are staged in the run's enclave (a
local folder, :mod:`mistill.evaluation.sampling`); a rerun after a crash samples only the answers
not staged yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
from mlflow.tracking import MlflowClient

from mistill.config import Config
from mistill.data.flips import CONDITIONS
from mistill.errors import MistillInputError
from mistill.evaluation.backends import resolve_backend
from mistill.evaluation.flip_test import (SAMPLE_COLUMNS, case_readings, category, checkpoint_readings, sample_row,
                                          sample_seed)
from mistill.evaluation.parsing import CodeIndex, parse_answer
from mistill.evaluation.sampling import SampleRequest, sample_notes
from mistill.params import DecodingParams
from mistill.stages.common import (Prepared, link_subject, load_prepared, load_tokenizer, make_backend,
                                   readout_subject)
from mistill.stages.flip_cohort import TAG_CONDITION_RUN
from mistill.stages.runner import open_stage, progress_label, stage_device
from mistill.tracking.naming import TAG_BACKEND, TAG_CORPUS
from mistill.validation import (check_arm, check_device, check_dtype, check_model_spec, check_no_text_fields,
                                check_positive, check_run_id, check_seed)

STAGE = "flip_test"
SAMPLES = "samples"
"""The enclave folder of the staged generations."""
METRIC_PREFIX = "flip/"


@dataclass(frozen=True)
class FlipTestConfig(Config, DecodingParams):
    """One checkpoint on a frozen evidence-flip cohort, every condition (App. N.3).

    cohort_run: a ``flip_cohort`` run that wrote its condition corpora (the frozen cohort).
    train_run: a ``train`` run (the checkpoint; arm, seed and precision come from it); else
        ``model`` (any spec) with ``arm`` naming what it stands for (``teacher``, ...).
    samples: answers per case and condition (the paper: 4); sample ``k`` shares its seed
        across the conditions. seed: the decoding seed the samples' seeds derive from.
    device: ``cpu``, ``cuda``, ``cuda:<n>`` or ``mps``.
    """

    cohort_run: str = ""
    train_run: str = ""
    model: str = ""
    arm: str = ""
    samples: int = 4
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def validate(self) -> None:
        check_no_text_fields(self)
        check_run_id(self.cohort_run, "cohort_run")
        check_run_id(self.train_run, "train_run")
        check_model_spec(self.model, "model", allow_empty=True)
        check_arm(self.arm, "arm", allow_empty=True)
        check_positive(self.samples, "samples")
        check_seed(self.seed)
        check_device(self.device)
        check_dtype(self.dtype)


def cohort_conditions(cohort_run: str) -> tuple[str, dict[str, Prepared]]:
    """The corpus a frozen cohort was drawn from (whose experiment holds the cohort and its test)
    and its four condition corpora, by condition; a run without them is refused (field
    ``cohort_run``)."""
    tags = MlflowClient().get_run(cohort_run).data.tags
    if tags.get("mistill.stage") != "flip_cohort":
        raise MistillInputError(f"run {cohort_run} is a {tags.get('mistill.stage')!r} run, not a flip_cohort run",
                                field="cohort_run")
    runs = {c: tags.get(TAG_CONDITION_RUN + c, "") for c in CONDITIONS}
    if not all(runs.values()):
        raise MistillInputError(f"flip_cohort run {cohort_run} wrote no condition corpora (its review is not "
                                f"frozen yet): the test needs the frozen cohort", field="cohort_run")
    out = {c: load_prepared(r) for c, r in runs.items()}
    cases = {c: [n.meta["flip_case"] for n in p.corpus.notes] for c, p in out.items()}
    if any(ids != cases["original"] for ids in cases.values()) or not cases["original"]:
        raise MistillInputError(f"flip_cohort run {cohort_run}: its condition corpora do not hold the same cases",
                                field="cohort_run")
    return tags[TAG_CORPUS], out


def run_flip_test(cfg: FlipTestConfig) -> str:
    corpus, conditions = cohort_conditions(cfg.cohort_run)
    subject = readout_subject(cfg.train_run, cfg.model, cfg.arm)
    decoding = cfg.decoding()
    device = stage_device(cfg.device)
    backend = resolve_backend(cfg.backend, device)
    inputs = {"flip_cohort": cfg.cohort_run, **({"train": cfg.train_run} if cfg.train_run else {})}
    original = conditions["original"]
    with open_stage(STAGE, cfg, original, inputs=inputs, corpus=corpus, model=subject.spec, arm=subject.arm,
                    seed=int(subject.seed) if subject.seed is not None else cfg.seed, precision=subject.precision,
                    tags={**subject.links, TAG_BACKEND: backend}) as run:
        if run.reused:
            return run.run_id
        link_subject(run, subject)
        tokenizer = load_tokenizer(subject.spec)
        requests, keys = [], []
        for cond, prepared in conditions.items():
            for note in prepared.corpus.notes:
                prompt = prepared.prompt(note, tokenizer).text
                case = note.meta["flip_case"]
                for k in range(cfg.samples):
                    seed = sample_seed(decoding, case, k)
                    requests.append(SampleRequest(f"{note.note_id}.{cond}.{k}", prompt, seed))
                    keys.append((case, cond, k, seed, note.meta["target_code"], note.meta["partner_code"]))
        gens = sample_notes(requests, run.enclave_dir / SAMPLES,
                            lambda: make_backend(backend, subject.spec, decoding, device=device, dtype=cfg.dtype),
                            decoding.to_dict(), desc=progress_label(f"flip_test {subject.arm}: generate"))
        index = CodeIndex(list(original.inventory.codes))
        rows = []
        for request, (case, cond, k, seed, a, b) in zip(requests, keys, strict=True):
            gen = gens[request.note_id]
            answer = parse_answer(gen.text, index, capped=gen.capped)
            rows.append(sample_row(case, cond, k, seed, answer.codes, valid=answer.valid, capped=gen.capped,
                                   n_tokens=gen.n_tokens, a=a, b=b))
        samples = pd.DataFrame(rows, columns=list(SAMPLE_COLUMNS))
        differ = {n.meta["flip_case"]: category(n.meta["target_code"]) != category(n.meta["partner_code"])
                  for n in original.corpus.notes}
        cases = case_readings(samples, differ)
        readings = checkpoint_readings(cases)
        run.log_table("flip_samples", samples)
        run.log_table("flip_cases", cases.reset_index())
        run.log_metrics({METRIC_PREFIX + k: float(v) for k, v in readings.items() if pd.notna(v)})
        print(f"flip_test: {subject.arm} on {readings['n_cases']} cases x {len(CONDITIONS)} conditions x "
              f"{cfg.samples} samples ({backend} sampled): D {readings['D']:+.3f} "
              f"[{readings['D_lo']:+.3f}, {readings['D_hi']:+.3f}] -> run {run.run_id}")
        return run.run_id


__all__ = ["FlipTestConfig", "run_flip_test", "cohort_conditions", "STAGE", "METRIC_PREFIX"]
