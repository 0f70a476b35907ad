"""Where the platform differs from the paper's text, as data.

Every rule a reader cannot find in the paper (a **[recon]** choice) and every place the
platform's default differs from what the paper states is one :class:`Deviation`. The registry
:data:`DEVIATIONS` is the source of ``docs/DEVIATIONS.md`` (a test checks that the two name
the same parameters and that every parameter exists in a config), and the report reads it to
name, for the runs it reads, every value that differs from the platform's default or from the
paper's stated value (:func:`deviations_in`).

A parameter is named ``<Class>.<field>``, where ``<Class>`` is one of :func:`config_classes`
(the stage configs, the arm, and the selection lock's sections). A run records the field under
its bare name in ``config.json`` (``config``) or, for an arm, under ``arm`` in the same file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mistill.distill.arms import ArmConfig
from mistill.stages.registry import stages
from selection.lock import EdgeRule, SelectionRule, TrainingSpec

PAPER_SILENT = "silent"
"""``Deviation.paper_value`` for a rule the paper does not state (a **[recon]** choice)."""


@dataclass(frozen=True)
class Deviation:
    """One choice: what the paper says, what the platform does, and the parameter that changes it.

    choice: a short name; section: the paper's section(s) the ``paper`` column cites.
    default: the platform's default of ``parameter`` (:data:`SET_BY_LOCK` for a lock field that
        every lock states).
    paper_value: the paper's value where it states one, else :data:`PAPER_SILENT`.
    when: the runs the choice concerns, as ``(field, values)``: only a run whose config holds one
        of ``values`` in ``field`` is checked (None: every run with the parameter).
    resolves: values that stand for another value, chosen when the run starts (``auto``); a run
        at one of them is checked on the value it resolved to where that is given
        (:func:`deviations_in`'s ``resolved``), and is no finding where it is not (the stage
        records the resolution itself, in a tag).
    """

    choice: str
    section: str
    paper: str
    platform: str
    parameter: str
    why: str
    default: Any
    paper_value: Any = PAPER_SILENT
    when: tuple[str, tuple[Any, ...]] | None = None
    resolves: tuple[Any, ...] = ()

    @property
    def recon(self) -> bool:
        """True iff the paper states no value (the platform's choice is a reconstruction)."""
        return isinstance(self.paper_value, str) and self.paper_value == PAPER_SILENT

    @property
    def class_name(self) -> str:
        return self.parameter.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.parameter.split(".", 1)[1]


@dataclass(frozen=True)
class Convention:
    """A fixed rule the paper does not state and no parameter changes (listed, not flagged)."""

    choice: str
    section: str
    platform: str
    where: str
    why: str


SET_BY_LOCK = "set by the lock"
"""``Deviation.default`` of a lock field with no default: every lock file states it."""

_D = Deviation
DEVIATIONS: tuple[Deviation, ...] = (
    # --- the Mistill objective ---
    _D("near-tie guard on c", "App. I.1",
       "no filter: the interaction term averages over every event",
       "by default none (the paper's rule); an opt-in guard (min_abs_margin > 0) drops events whose "
       "teacher or student |margin| is below it from the interaction and write terms; events with "
       "margin exactly 0 or a non-finite c always leave",
       "ArmConfig.min_abs_margin",
       "c divides by the margin; on the embedded default, without a guard one P1 event at "
       "|margin| 0.018 made the interaction gradient about 10^4 times larger in the first step "
       "(benchmarks/RESULTS.md, min_abs_margin); a 0.5-nat guard drops 22-29% of events per phase",
       0.0, 0.0),
    _D("teacher pool on the P1 window", "App. I.1",
       "the teacher's prose-time set supervises the W = 8 rows before each P1 event",
       "the P1 emission pool when no locus run is given, or when the locus run has no "
       "prose-time set (no chapter mention had a locus to attribute); the targets and train runs "
       "carry the tag mistill.deviation=p1_window_pool=emission and print a warning (the "
       "pipeline gives the teacher's locus run, so its runs deviate only in the second case)",
       "TargetsConfig.locus_run",
       "a targets run started without a locus pass (e.g. a model the locus pass has not run on), "
       "or on a teacher whose forcing probes never cross theta",
       ""),
    _D("attention KL clamp", "App. J.3",
       "a KL divergence between pooled rows; direction and clamp not stated",
       "KL(teacher || student), both rows clamped at 1e-8",
       "ArmConfig.attention_eps", "keeps the KL finite on empty buckets", 1e-8),
    _D("ULD position alignment", "App. J.3",
       "ULD needs no shared vocabulary; how positions pair is not stated",
       "character offsets: each student token pairs with the teacher token holding its first "
       "character (index: pair by position, Boizard et al.)",
       "ArmConfig.uld_alignment", "the two tokenizations cover the same text", "char_offset"),
    _D("top-32 targets", "App. I, J.3",
       "KL to the teacher's top-32 distribution; ULD over the same number of bins",
       "the teacher renormalised over its top-32, the student's full softmax; ULD cuts both to "
       "the teacher's top-32", "TargetsConfig.top_k", "only the top-k are stored", 32, 32),
    _D("matmul precision on CUDA", "App. J.2",
       "bf16 weights or fp32 master weights; matmul precision not stated",
       "float32 matmuls in TF32 on CUDA (the recomputed attention rows)",
       "TrainStageConfig.tf32", "the q.k inputs are bf16 projections; no effect on the CPU", True),
    # --- the generation probe ---
    _D("generation probe interval", "App. L.2",
       "a generation-level probe on a few notes during training, added after the GOLD run; no interval given",
       "off by default; with probe_every=N, every N optimizer steps and after the last",
       "TrainStageConfig.probe_every", "decoding during training costs time; a run names its interval", 0),
    _D("generation probe notes", "App. L.2", "a few notes",
       "the first 4 validation notes in corpus order, the same at every probe", "TrainStageConfig.probe_notes",
       "fixed notes make probes comparable across steps and arms", 4),
    _D("generation probe flag", "App. L.2",
       "the probe would have caught category-code answers and truncated traces; no rule given",
       "flagged when category codes are at least half of the answers' entries or at least half of the "
       "generations are truncated (capped or never closing their reasoning)",
       "TrainStageConfig.probe_flag_share", "GOLD's answers were all categories; a healthy arm has none", 0.5),
    _D("generation probe engine", "App. L.2",
       "the probe decodes with the student being trained; the engine is not stated",
       "auto: vLLM where it is installed and the device is CUDA, else HF's batched generation with the model "
       "being trained; each note drawn with its own seed; the vLLM engine is built once per run from the student "
       "as loaded and given the student's current weights (through files in the run's work dir) before each probe; "
       "a run of several processes probes with HF; the run records the engine (tag mistill.probe_backend)",
       "TrainStageConfig.probe_backend",
       "one engine start per run, not per probe; the probe's metrics read only the generations, so the two "
       "engines' probes differ only as their samples do",
       "auto", resolves=("auto",)),
    # --- the on-policy arms (OPD, GOLD) ---
    *(_D(f"sampling engine ({stage})", "App. J.5, Q (G)",
         "every evaluation and the teacher's traces generated in vLLM, sampling seeded per note; a seed does not "
         "reproduce tokens across GPUs, builds or batch composition",
         "auto: vLLM where it is installed and the device is CUDA, else HF's batched generation, each note drawn "
         "with a generator seeded by its own seed (its tokens independent of its batch-mates); the run records "
         "the engine (tag " + tag + ")",
         f"{cls}.backend",
         "vLLM needs a CUDA GPU (or its CPU build); on the same seed the two engines draw different tokens from the "
         "same distribution, as the paper's own runs did across GPUs and builds",
         "auto", "vllm", resolves=("auto",))
      for stage, cls, tag in (("generate", "GenerateConfig", "mistill.generate.backend"),
                              ("evaluate", "EvaluateConfig", "mistill.backend"))),
    _D("on-policy rollout engine", "App. J.3, J.5",
       "OPD's trainer and a vLLM rollout engine share one H200",
       "auto: TRL's colocated vLLM engine where vLLM is installed and the device is CUDA, else transformers' "
       "generation inside TRL's trainer (hf); the run records the engine (tag mistill.rollout_backend) and, when "
       "it is hf, the deviation (tag mistill.deviation=rollout_backend=hf and config.json's deviations); "
       "checked on the opd and gold arms only",
       "TrainStageConfig.rollout_backend",
       "vLLM needs a CUDA GPU; elsewhere transformers samples from the same distribution, more slowly",
       "auto", "vllm", when=("arm", ("opd", "gold")), resolves=("auto",)),
    _D("rollout engine's GPU memory", "App. J.3, J.5",
       "trainer and vLLM rollout engine share one 141 GB H200 (OPD and GOLD); the engine's share is not stated",
       "TRL's colocated engine may take 0.2 of the GPU's memory (its copy of the student, activations, "
       "key/value cache); the trainer keeps the rest",
       "TrainStageConfig.rollout_gpu_memory",
       "on an H200, 28 GiB hold a 4B student and the cache of two to three paper-length rollouts, while GOLD's "
       "off-policy step at the paper's cap peaks at 95 GiB beside it (benchmarks/RESULTS.md)",
       0.2, when=("arm", ("opd", "gold"))),
    _D("arm epochs", "App. J.3, J.4",
       "every arm two epochs; the GOLD run one, a compute cut recorded before its final run",
       "0 keeps the recipe's epochs (two); gold.yaml sets 1, as the paper's GOLD run",
       "ArmConfig.epochs", "the GOLD row is quoted at the settings it ran", 0, 0),
    _D("on-policy rollout cap", "App. J.3, L.2",
       "OPD: 12,288 tokens, never reached; GOLD: 6,144, after 16,384 and 8,192 ran out of memory in the hybrid "
       "ULD loss, the teacher's completions cut to the same cap (200 of 500 traces lost their end)",
       "12,288 (OPD); gold.yaml 6,144, the teacher's traces cut after as many student tokens and their count "
       "logged as train/truncated_completions", "ArmConfig.rollout_cap",
       "the GOLD null is a property of that cap, so the arm carries it", 12288, 12288),
    _D("GOLD on-policy fraction", "App. J.3, J.4",
       "0.5 for GOLD, because a fully on-policy first run collapsed to degenerate output; OPD fully on-policy",
       "1.0 (OPD); gold.yaml 0.5 (TRL's lmbda: each micro-step on-policy with this probability)",
       "ArmConfig.on_policy_fraction", "the settings the GOLD row ran at", 1.0, 1.0),
    _D("GOLD shared-token divergence", "App. J.3",
       "OPD: the generalised JSD at beta 1; GOLD's beta is not stated",
       "1 (OPD); gold.yaml 0.5, TRL's GOLD default, for the hybrid loss's JSD on the tokens both vocabularies "
       "share", "ArmConfig.opd_beta", "upstream's published setting", 1.0, 1.0),
    _D("GOLD hybrid loss", "App. J.3",
       "the hybrid ULD loss (JSD on shared tokens, sorted-probability ULD on the rest) with upstream's "
       "text-span alignment",
       "the hybrid loss with adaptive weights (upstream's); false: ULD on every token",
       "ArmConfig.uld_hybrid", "the loss the GOLD row ran", True, True),
    # --- Feature-KD ---
    _D("Feature-KD attention positions", "App. J.3, J.4",
       "64 trace positions sampled per note; a seed fixes them",
       "64 drawn uniformly without replacement, fixed per (seed, note) across epochs",
       "ArmConfig.fkd_positions", "the paper's count; the draw is reproducible", 64, 64),
    _D("Feature-KD layer pairs", "App. J.3",
       "four uniformly mapped layer pairs",
       "the last layer of each of four equal blocks of each model",
       "ArmConfig.fkd_layer_map", "the last layers always pair", "block_end"),
    _D("Feature-KD hidden site", "App. J.3",
       "hidden states at those layers",
       "the residual stream entering the layer",
       "ArmConfig.fkd_hidden_site", "the state the attention rows are computed from", "input"),
    _D("Feature-KD adapter count", "App. J.3",
       "a linear adapter",
       "one adapter shared by all four pairs",
       "ArmConfig.fkd_adapter", "singular in the text (TinyBERT's single W_h)", "shared"),
    _D("Feature-KD adapter bias", "App. J.3",
       "the seed controls the adapter's initialisation; its form is not stated",
       "nn.Linear's default U(+-1/sqrt(d_S)) from a generator seeded by the run's seed, with bias",
       "ArmConfig.fkd_adapter_bias", "reproducible and independent of the global RNG", True),
    _D("Feature-KD RMS epsilon", "App. J.3",
       "hidden states RMS-normalised per position; no epsilon stated",
       "epsilon 1e-6", "ArmConfig.fkd_rms_eps", "keeps an all-zero state finite", 1e-6),
    # --- the instrument ---
    _D("exact P2 nominees", "App. C",
       "the P2 re-run patches the event's top-24 by |A_h| and the running global top-8 exactly",
       "P2 events patched exactly with those nominees", "AttributeConfig.exact_p2",
       "the paper's exact procedure", True, True),
    _D("P2 nominees per event", "App. C", "top-24 by |A_h|", "top-24",
       "AttributeConfig.p2_top_nominees", "the paper's", 24, 24),
    _D("P2 global nominees", "App. C", "the running global top-8", "top-8",
       "AttributeConfig.p2_global_nominees", "the paper's", 8, 8),
    _D("P2C nominees per event", "App. D",
       "the exact contrastive refinement patches the event's top-40", "top-40",
       "AttributeConfig.p2c_top_nominees", "the paper's", 40, 40),
    _D("P2C global nominees", "App. D", "and the running global top-16", "top-16",
       "AttributeConfig.p2c_global_nominees", "the paper's", 16, 16),
    _D("running global ranking of P2/P2C nominees", "App. C",
       "the running global ranking is defined over chapter events only",
       "the chapter ranking supplies the global nominees of every kind",
       "AttributeConfig.phase_running_global", "the only ranking the paper defines", False),
    _D("teacher ranking population", "Sec. 4.2, App. C",
       "the teacher is ranked on the 100 characterization notes, the validation notes",
       "the pipeline ranks and knocks in the teacher on the validation split",
       "PipelineConfig.teacher_split", "the paper's", "val", "val"),
    _D("last note's knock-in donor", "Sec. 2.3",
       "the corrupted run is the next note in the corpus",
       "the last note's next note is the first", "KnockinStageConfig.donor_wrap",
       "the paper reports knock-in on every note, so the last note had a donor", True),
    _D("no matched event in the next note", "Sec. 2.3",
       "a matched event with a different emitted choice; what happens without one is not stated",
       "the event goes to the first later note that has a match (drop: left out)",
       "KnockinStageConfig.donor_no_match",
       "the paper reports P2C knock-in on 92 of 92 notes, which dropping would not give", "next"),
    _D("own-heads M4 donor (last note)", "App. L.4",
       "the donor of the arm's own traces is not stated",
       "the next usable own trace; the last wraps to the first", "OwnHeadsConfig.donor_wrap",
       "the teacher's rule", True),
    _D("own-heads M4 donor (no match)", "App. L.4", "not stated",
       "the first later own trace with a match", "OwnHeadsConfig.donor_no_match",
       "the teacher's rule", "next"),
    _D("M4 random floor", "App. K",
       "the count-matched random set is redrawn for every bin",
       "one draw per note, phase and bin", "OwnHeadsConfig.n_random", "the paper's", 1, 1),
    _D("spread of the random floor", "App. K",
       "one count-matched random draw per bin; its spread over draws is not reported",
       "the recorded floor stays the single seeded draw; four more draws per note, phase and bin ride in the "
       "same knock-in batch and are logged only as the floor's mean and standard deviation over draws",
       "KnockinStageConfig.floor_draws", "one draw's floor is noise-sized on a few notes; the spread shows it", 5),
    # --- the locus pass ---
    _D("forcing suffix", "App. F", "suffix B (\"\\nSo the code here is\"); D and A re-run for Table 25",
       "suffix B; Table 25 re-runs the walk-back under A and D", "LocusStageConfig.suffix", "the paper's",
       "B", "B"),
    _D("decisive forced margin", "App. F", "theta = 2 nats", "2 nats", "LocusStageConfig.theta",
       "the paper's", 2.0, 2.0),
    _D("walk-back grid", "App. F", "steps of 8 tokens, up to 512 back, four more steps recorded",
       "8 / 512 / 4", "LocusStageConfig.step", "the paper's", 8, 8),
    _D("attribution window", "App. F", "the 64 tokens ending at the locus, plus the suffix", "64 tokens",
       "LocusStageConfig.width", "the paper's", 64, 64),
    _D("chapter mentions per note", "App. F", "every chapter mention", "every mention (0)",
       "LocusStageConfig.max_mentions", "the paper's; a cap is for quick runs", 0, 0),
    _D("suffixes compared in the pipeline", "App. F, Table 25",
       "the walk-back re-run under suffixes D and A",
       "the pipeline re-runs it under D only (each compared suffix repeats every walk-back); the "
       "locus stage's own default compares A and D", "PipelineConfig.locus_compare_suffixes",
       "keeps the CPU demo short", ("D",), ("A", "D")),
    _D("residual-swap layer grid", "App. F, Figure 5",
       "a grid of layers (L4, L12-L28 are named); the grid itself is not stated",
       "every 4th layer from layer 0 (empty swap_layers)", "LocusStageConfig.swap_layers",
       "matches the layers the paper names on a 40-layer teacher", ()),
    # --- evaluation ---
    _D("audit sheet context", "Sec. 2.2, App. C",
       "the reader reads the trace context around the earlier mention and around the decision",
       "300 characters of the trace either side of each", "AuditFrameConfig.context_chars",
       "enough for a candidate line and the sentence around it; the width is not stated", 300),
    _D("LAS simulator note length", "App. K",
       "the simulator reads the note", "the whole note",
       "LasSimulatorConfig.max_note_words", "the paper's", 0, 0),
    _D("LAS note cap in the pipeline", "App. K",
       "the simulator reads the note",
       "the pipeline caps the simulator's note at 128 words",
       "PipelineConfig.las_max_note_words",
       "a CPU cost control for the embedded default; pass 0 for whole notes", 128, 0),
    _D("App. E events in the pipeline", "App. E, Tables 20-23",
       "the key blocking at every chapter and contrastive event; the edits at up to 20 events per note",
       "the pipeline's key_block, trace_edit and note_edit read at most 2 events per note and phase",
       "PipelineConfig.read_side_max_events",
       "a CPU cost control for the embedded default; pass 0 for the stages' own defaults", 2, 0),
    _D("pipeline: NULL positions", "App. C", "20 NULL positions per note", "10 per note",
       "PipelineConfig.n_null", "a CPU cost control for the embedded default; the events stage keeps 20", 10, 20),
    _D("pipeline: knock-in set sizes", "Sec. 3.1, App. D, Table 10", "k = 3, 8, 16, 40 and 100",
       "k = 3, 8, 16, 40 (no k = 100)", "PipelineConfig.k_bins",
       "a CPU cost control for the embedded default; the knock-in stage keeps every k", (3, 8, 16, 40),
       (3, 8, 16, 40, 100)),
    _D("pipeline: split-half draws", "App. F", "200 split-half draws", "50 draws",
       "PipelineConfig.stability_splits", "a CPU cost control for the embedded default", 50, 200),
    _D("pipeline: P1 and NULL nominees", "App. C", "top-40 per event and the running global top-16",
       "top-8 and top-4", "PipelineConfig.top_nominees",
       "exact patches are most of the attribution pass's time on a CPU (global: PipelineConfig.global_nominees, "
       "4 against 16)", 8, 40),
    _D("pipeline: P2 nominees", "App. C", "top-24 per event and the running global top-8", "top-6 and top-2",
       "PipelineConfig.p2_top_nominees", "as above (global: PipelineConfig.p2_global_nominees, 2 against 8)", 6, 24),
    _D("pipeline: P2C nominees", "App. D", "top-40 per event and the running global top-16", "top-8 and top-4",
       "PipelineConfig.p2c_top_nominees", "as above (global: PipelineConfig.p2c_global_nominees, 4 against 16)",
       8, 40),
    _D("LAS answer length", "App. K", "not stated",
       "the answer target fitted to 96 tokens", "LasSimulatorConfig.max_answer_tokens",
       "the simulator needs a bounded target", 96),
    _D("LAS simulator training steps", "App. K", "fine-tuned once on the teacher's training traces; no step count, "
       "learning rate or schedule stated",
       "plain AdamW, one note (both inputs) per step, max_steps steps (reproduce passes 493: one pass over the "
       "training traces; the pipeline's demo trains one step, PipelineConfig.las_max_steps)", "LasSimulatorConfig.max_steps",
       "a CPU run trains a few steps; a reproduction sets one pass", 8),
    _D("LAS simulator learning rate", "App. K", "not stated",
       "constant 1e-4, no warm-up", "LasSimulatorConfig.lr",
       "a short fine-tune of a small model", 1e-4),
    # --- lambda selection ---
    _D("training notes of the lambda selection", "App. I.3, J.4",
       "nine runs at 100 training notes, the Vanilla CoT-KD reference on the same 100; how the 100 "
       "were drawn is not stated",
       "the training split's note ids sorted, numpy default_rng(train_notes_seed).permutation, the first "
       "train_notes (the bf16 selection's lock: 100 notes, seed 0); draws at one seed are nested",
       "TrainStageConfig.train_notes_seed", "a deterministic, seeded draw that any run can repeat", 0),
    _D("tie-break fallback", "App. I.3, I.4, M.2",
       "ties within the band broken by M1 at P2C; no fallback stated",
       "a NaN tie-break ranks last; a tie left by the tie-break goes to the higher selection "
       "metric, then to the smaller lambda", "SelectionRule.tie_fallback",
       "a pick must always be reached", ("metric", "smaller_lambda")),
    _D("tie rule", "App. I.3, I.4, M.2, O",
       "M1 at P2C (App. I, M.2); the smallest lambda within the band (App. O)",
       "either, as the lock states; smallest lambda on an untied grid compares (lambda_P1, "
       "lambda_P2) in that order", "SelectionRule.tie_break",
       "App. O's grid is tied; a pair has no single smallest", SET_BY_LOCK),
    _D("validity floor", "App. O",
       "among cells with a valid-answer rate of at least 0.95",
       "optional; a cell whose valid-answer rate was not measured is ineligible",
       "SelectionRule.validity_floor",
       "an unmeasured cell cannot be shown to meet the floor", None),
    _D("tie band of the bf16 selection", "App. I.3",
       "the pre-registered rule names no band",
       "the i3-bf16-selection lock uses a band of 0", "SelectionRule.tie_band",
       "the measured 0.004 band belongs to App. I.4", SET_BY_LOCK),
    _D("further extensions", "App. I.4",
       "the second-extension condition: a further cell only if the new edge cell beats the "
       "previous pick by more than the band",
       "extensions continue only beyond the last added cell, up to max_extensions (the "
       "i4-fp32-reselection lock: 2, so the condition can trigger a run)",
       "EdgeRule.max_extensions", "the paper is silent on the other side of the grid", 1),
    # --- the report ---
    _D("Table 11 heads", "App. D", "representative heads",
       "the heads in the top 8 of any calibrated phase", "ReportConfig.importance_heads",
       "the paper does not say how its heads were chosen", 8),
    _D("write-side profile", "App. D",
       "shared heads rank high in all three phases, specific ones in one",
       "ranks high = in the phase's top 40", "ReportConfig.profile_k",
       "'rank high' is not defined", 40),
    _D("Table 11 layer blocks", "App. D",
       "0-11 / 12-23 / 24-31 / 32-39 of 40 layers",
       "the same blocks as fractions 0.3 / 0.6 / 0.8 of any model's depth",
       "ReportConfig.layer_blocks", "students have other depths", (0.3, 0.6, 0.8)),
    _D("Table 40/41 reference", "App. I.3",
       "Vanilla CoT-KD trained on the same notes, seed 0",
       "the report's reference arm on the lock's split, at the lock's seed when present, else "
       "seeds averaged", "ReportConfig.reference_arm",
       "the platform has no separate same-notes Vanilla run", "vanilla-bf16"),
    _D("region readers", "App. E, Table 17",
       "a family read off the numbers ('a judgement call'); region readers put up to 0.47 of their "
       "attention on the region at a lift of up to 9.4",
       "a head whose median region lift reaches 4 and median share on the region 0.2",
       "ReadSideConfig.region_reader_lift", "the paper's region readers sit far above; its mixed heads below",
       4.0),
    _D("region-reader share", "App. E, Table 17", "as above", "median share on the region at least 0.2",
       "ReadSideConfig.region_reader_share", "with the lift, separates reading the region from touching it",
       0.2),
    _D("prose readers", "App. E, Table 17",
       "prose readers put 0.73 to 0.84 of their attention on the trace prose",
       "a head that is not a region reader and whose median share on the trace prose reaches 0.5",
       "ReadSideConfig.prose_reader_share", "below the paper's prose readers, above its mixed heads", 0.5),
    _D("key-block heads: region readers", "App. E, Table 20",
       "three heads named by hand: L28H21 and L26H36 for the emitted chapter's lines, L30H11 for the "
       "near-miss's earlier mentions",
       "with no heads named: the P1 top-k's region readers (by the read-side rule), in ranking order, at most 2",
       "KeyBlockConfig.region_heads", "the paper's two region readers; names can be given (heads=...)", 2),
    _D("key-block heads: near-miss loop-back", "App. E, Table 20", "as above (L30H11, with L38H39 as its pair)",
       "with no heads named: the P2C top-k's heads with the largest median share on the near-miss's earlier "
       "mentions, at most 2, each blocked from those mentions and from the near-miss's line",
       "KeyBlockConfig.loopback_heads", "the paper's loop-back pair", 2),
    _D("trace-edit mediation set", "App. E, Tables 21-22",
       "the teacher: L30H11 and L38H39 named by hand; the students: their own top-2 contrastive heads",
       "the attribute run's top 2 of the P2C ranking, or heads named in mediation_heads",
       "TraceEditConfig.n_mediation", "the students' rule, applied to every model", 2),
    _D("trace-edit candidates", "App. E, Table 21", "a replacement of the same token length",
       "at most 64 candidate fillers or codes tried per kind and event; the event goes without that kind when "
       "none aligns token for token", "TraceEditConfig.max_tries", "bounds the tokenizations per event", 64),
    _D("note-edit fillers", "App. E, Table 23", "a token-length-matched filler for every occurrence",
       "at most 64 fillers tried per word; the variant goes without when a word finds none that keeps the "
       "whole edit aligned token for token", "NoteEditConfig.max_tries", "bounds the tokenizations per event", 64),
    _D("EURLEX57K candidate list", "App. P",
       "the teacher labels an act from a shown candidate list of EuroVoc concepts (its size and draw unstated)",
       "each act lists its gold concepts, then concepts related to them (broader, narrower, siblings), then "
       "others drawn at random (seeded by the prepare seed and the act), up to 20 labels, shuffled",
       "PrepareConfig.candidates", "the paper does not say how the candidate list was built", 20,
       when=("task", ("eurlex57k",))),
    _D("EURLEX57K retrieval ranking", "App. P",
       "the teacher's native micro-F1 on the fresh acts is set beside the top-5 of a retrieval ranking (the "
       "retriever unnamed)",
       "the act's shown candidate list ranked by the idf-weighted share of each label's words found in the act "
       "(idf over the concept file's labels; ties to the larger mass found, then the label), its first "
       "retrieval_top scored like the teacher's answer on the same acts; retrieval_scope=inventory ranks every "
       "concept instead",
       "GenerateConfig.retrieval_scope", "the paper does not say which retrieval ranking it scored", "candidates"),
    _D("Table 50 direction", "App. M, Table 50",
       "pre-registered expectations marked met or not",
       "direction only (higher / lower / level) at a paired sign-test alpha of 0.05",
       "ReportConfig.sign_alpha", "no machine-readable expectations exist", 0.05),
)
"""One entry per row of ``docs/DEVIATIONS.md``'s table."""

CONVENTIONS: tuple[Convention, ...] = (
    Convention("namings written otherwise than their item", "App. O, P",
               "an event is placed only at item characters from which the written naming ends with the same "
               "characters as the item (an import alias, a capitalised label); a divergence at a blank gives no "
               "event; without a region-level decision (P1) the first character is a P2 candidate; NULL letters "
               "are the items' first characters (A-Z when fewer than two)",
               "mistill.instrument.events.extract_events",
               "the paper's adapters locate namings and trie-divergent tokens without saying how an alias aligns"),
    Convention("MuSiQue adapter", "App. O",
               "candidates: the passage titles, the answer and its aliases; the answer is the last 'Answer:' line "
               "after </think> (abstentions give no event); no P2C (the paper's contrastive event is a diagnostic); "
               "metric: SQuAD-normalised EM/F1, the best over answer and aliases; an event's competitors are the "
               "other candidates' own first tokens from the divergence on",
               "mistill.tasks.musique",
               "the paper names the answer-emission event and the official F1, not the inventory or line format"),
    Convention("BigCodeBench through the stages", "App. P",
               "prepare -P task=bigcodebench: the note is the problem's instruct prompt (no candidate list), its id "
               "the task_id with '/' written '-'; each problem's API namings are its note's own candidates and its "
               "prompt's imports its aliases; gold and answer are sets of API namings (the reference program's; "
               "the last code block's), so set counts give the API F1; a problem whose reference names no API of "
               "its libraries is left out; split_sizes deals the problems in the release's order; generate runs "
               "each answer's code block and the problem's tests in the sandbox (pass@1); an event's competitors "
               "are the alternative namings' own first tokens",
               "mistill.tasks.bigcodebench.load_bigcodebench_corpus",
               "the paper gives the task, the prompt's libraries and pass@1, not the prompt, the batches or how an "
               "answer's namings are read"),
    Convention("MuSiQue-Ans evidence pairs", "App. O",
               "the evidence-flip machinery on free-text answers: the cohort lock names App. O's conditions "
               "(original, flipped, irrelevant, control); teacher success and the answers' A and B are exact "
               "matches under the task's EM (A with its aliases); the partner need not be a candidate; the "
               "flipped version's gold is the partner alone; a control edit may not touch the evidence (its "
               "meaning is the reviewer's to judge); the pair slice is the dev file's questions after the "
               "evaluation questions (prepare -P split_sizes=...,807), drawn in a seeded order of 385 bases; a "
               "pair's cluster is its base-question group; the teacher's gate masks its answer-emission (P2) "
               "top-40 of tree MQ in the prefill and at decode steps (flip_test -P mask_regime=prefill), the "
               "random draws taking as many other heads of each layer (-P mask_random=n, seeded)",
               "mistill.data.flips",
               "the paper describes the pairs, their controls and paired correctness, not the slice, the order or "
               "how an answer is matched"),
    Convention("KodCode through the stages", "App. P",
               "prepare -P task=kodcode: KodCode-V1 rows as train notes in BigCodeBench's label space; a problem's "
               "libraries are the modules its reference solution imports; the note is the question, then the "
               "solution's import lines and declared functions as the code to start from; candidates: the API "
               "namings of question, starting code and solution; gold: the solution's; a problem whose solution "
               "names no API is left out; -P split_sizes=2000 draws the training problems with order_seed (or "
               "-P split_file lists a locked split); pytest tests run in the sandbox with the answer as the "
               "module 'solution'",
               "mistill.tasks.kodcode.load_kodcode_corpus",
               "the paper names KodCode's locked split of 2,000 and the first-mention events, not the prompt, "
               "the eligibility rule or the draw"),
    Convention("the evidence-flip test's RandHeads pick", "App. N, Table 54",
               "tree EF flip-tests seed 0 of tree M2's matched-selection RandHeads pick (the arm m2-randheads) "
               "beside the teacher and the twelve locked checkpoints; another seed's pick is flip-tested by hand "
               "(flip_test -P cohort_run=<the cohort> -P train_run=<its train run>)",
               "mistill.runbook.FLIP_CHECKPOINTS",
               "the paper's fourteen checkpoints hold one RandHeads pick, descriptive, without naming its seed"),
    Convention("the programming pilot's plan", "App. P",
               "tree PP: BigCodeBench's development tasks are the release's first 120 (the ranking batches) and "
               "next 60 (the assessment batch), traced by the teacher in the tree itself with the same per-note "
               "seeds as tree BC; the teacher's targets pool its ranking frozen on BC's ranking batch; pass@1 is "
               "read on the 180 as one evaluation split; each task is its own near-duplicate group; the report "
               "reads the own-heads runs on the assessment batch (-P own_heads_split=val) and the answers on "
               "the evaluation split, with 10,000-draw intervals",
               "mistill.runbook._pilot_tree",
               "the paper gives three screening batches of 180 tasks, 40 common-support inputs in 40 "
               "near-duplicate groups, and 180 groups, not which tasks or how the groups were formed"),
    Convention("MuSiQue-Ans through the stages", "App. O",
               "prepare -P task=musique: the prompt lists no candidates; the note is the passages in the release's "
               "order ('Passage i: title', then the text) and the question; each question's candidates are its "
               "note's own; a question's group (the cluster of note-clustered statistics) is the first single-hop "
               "id of its composed id; train-file questions are train notes, dev-file questions test notes; "
               "answer EM / F1 are macro means over the questions; the distillation's one pool is P2's",
               "mistill.tasks.musique.load_musique_corpus",
               "the paper gives the task, its base-question groups and its loss phase, not the prompt or the "
               "grouping rule"),
    Convention("EURLEX57K adapter", "App. P",
               "items: the EuroVoc labels of the release's concept file; namings: whole words, case-insensitive; "
               "relation: broader, narrower or sibling from a local id -> broader-ids file (the release has no "
               "hierarchy); answer: the last JSON list of labels or ids; metric: micro-F1",
               "mistill.tasks.eurlex",
               "the paper's relation rule needs the EuroVoc hierarchy, which the release does not ship"),
    Convention("BigCodeBench adapter", "App. P",
               "namings: qualified module.attribute names, aliases read from the prompt's imports without running "
               "them; inventory: the namings the prompts and the canonical solution write within the task's "
               "libraries; relation: same module, another attribute; answer: the last fenced python block; "
               "metric: parses, the API namings' F1 against the solution, and pass@1 (the answer's code block "
               "then the task's tests, executed in the sandbox)",
               "mistill.tasks.bigcodebench",
               "the paper names the API-naming events and pass@1, not how a naming or an answer is read"),
    Convention("the execution sandbox of pass@1", "App. P",
               "a child Python in isolated mode in a fresh temporary folder, removed afterwards, with a minimal "
               "environment; limits 60 s wall clock, 4 GiB of address space, 64 MiB files (SandboxLimits); no "
               "network (a new network namespace where the kernel allows one, and a socket guard always); one "
               "terminal verdict per task: passed, failed, error, timeout, memory or no_code",
               "mistill.evaluation.sandbox",
               "the paper states sandboxed execution with time and memory limits, not the limits or the isolation"),
    Convention("competitors of a word-item divergence", "App. P",
               "for a label space written in words (EuroVoc labels), a P2 or P2C event's competitors are the "
               "alternative items' own first tokens from the divergence on (every inventory label sharing the "
               "head, or the near-miss), not a one-character substitution; a divergence inside a word token is "
               "dropped, never moved",
               "mistill.instrument.events.realize_events",
               "the paper marks 'trie-divergent tokens' without saying how a word's alternatives are tokenized"),
    Convention("the embedded parts catalogue", "App. O, P",
               "part numbers FAM-123, families with distinct first letters (the first letter is P1, the family "
               "the P2C relation, the dash never scored); seeded maintenance orders and scripted traces like the "
               "clinical synthetic corpus's; -P task=catalog on prepare and pipeline",
               "mistill.tasks.synthetic_catalog",
               "not the paper's: a generated label space, public and small, on which the stages are shown to run "
               "unchanged, as the paper's public tasks would need"),
    Convention("the trees a result reads", "App. Q",
               "reproduce runs, for a result, the steps of its entry points in HD-001 for the characterization "
               "results (R-C7: HD-001 and HD-002; R-C14: the instruction control) and in DT-000 and DT-001 for the "
               "distillation results, with every step they read",
               "mistill.runbook.result_trees",
               "App. Q names each result's artifacts, not a tree"),
    Convention("the distillation tree's prose-time set", "Sec. 4.2; App. I.1",
               "the locus pass on the distillation corpus's teacher ranking (the validation notes, with the "
               "shortlist), whose prose-time set pools the targets' P1 window rows",
               "mistill.runbook.paper_plan",
               "the paper takes the set from the teacher's run on the shortlist, which these notes are"),
    Convention("two characterizations compared", "App. C, G, H; Tables 9, 35, 36",
               "rankings compared per phase at P1, P2 and P2C (NULL has no ranking): Spearman over all heads and "
               "the top-8, 16 and 40 overlaps; two models' rankings are not compared, only their global sets' "
               "knock-in side by side; unnamed pairs are found only among attribute runs differing in detach",
               "analysis.characterization_compare",
               "the tables name the correlations and overlaps, not which phases or k are listed"),
    Convention("patient-level collapse", "App. C, D",
               "a note without a value is dropped; a patient's value is the mean of its notes; medians and sign "
               "tests over patients, no bootstrap interval", "analysis.characterization_compare",
               "the paper states the collapse and its outcome, not the arithmetic"),
    Convention("learning-curve readouts", "App. M.5, Table 53",
               "micro-F1 and M1 at P2C at every size, mean and sd over seeds; Mistill against each Vanilla "
               "CoT-KD arm at the same size, seed i with seed i, note-clustered differences",
               "analysis.training_tables", "the table's columns, read from App. M.5's text"),
    Convention("training cost", "Sec. 6; App. I.5",
               "seconds per note count the optimizer steps only (no loading or saving); peak memory is torch's "
               "on the device, else MLflow's sampled GPU memory", "analysis.training_tables",
               "the paper reports the figures, not how they were taken"),
    Convention("evidence-flip draw", "App. N.2",
               "eligible patients shuffled by numpy default_rng(lock seed), the first n drawn, one note each by "
               "the same generator; eligible: the teacher's screen answer is valid and holds the target code, "
               "which is gold", "mistill.data.flips",
               "the paper states a seeded, teacher-success-conditioned draw of 300, not its arithmetic"),
    Convention("evidence-flip checks", "App. N.1-N.2",
               "the original has no edits; the flip's evidence spans lie in the text it replaced or wrote; the "
               "irrelevant edit leaves the evidence alone and matches the flip's length in words; the order edit "
               "permutes words; masks are counted in the model's tokens on the note alone (a token is masked when "
               "any of its characters is); a length or mask mismatch passes only when the proposal declares it, "
               "and is recorded", "mistill.data.flips",
               "the paper names the conditions and their one exception, not the checks"),
    Convention("the freeze", "App. N.2",
               "FROZEN holds a sha256 per version (text and masks), per reviewed proposal, of the ledger, the lock "
               "and the source corpus; written once, re-verified on every later read", "mistill.data.flips",
               "the paper freezes the flips by hash; what is hashed is not listed"),
    Convention("the audit's draw", "Sec. 2.2, App. C, Table 5",
               "the sample is spread one event at a time over the eight strata that have events left, in a fixed "
               "order, and drawn within each by numpy default_rng(seed); an event is aligned when every student's "
               "events run realizes its id; the sheet's order is a seeded shuffle", "mistill.evaluation.audit_frame",
               "the paper states 181 events over eight strata with population weights, not the allocation"),
    Convention("the evidence-flip pool", "App. N.2",
               "reproduce's tree EF prepares 400 release notes by App. A's selection on their retrieved "
               "shortlist, the teacher screens them, and the cohort's lock draws 300 patients among them outside "
               "the distillation corpus's patients", "mistill.runbook.paper_plan",
               "the paper draws 300 patients disjoint from every development cohort, not the pool they came from"),
    Convention("evidence-flip decomposition", "App. N.3, Table 54",
               "D = d_lose_a + d_adopt_b, with d_lose_a = (mean v under the original - Pr(v = +1 under the flip)) / 2 "
               "and d_adopt_b = Pr(v = -1 under the flip) / 2; the category-level D compares the first three "
               "characters of the codes, on cases whose categories differ; a sample's seed is keyed by the case "
               "and the sample index", "mistill.evaluation.flip_test",
               "the paper names the decomposition, the category-level secondary and the shared seed key, not "
               "their arithmetic"),
    Convention("the retriever's training notes", "App. A",
               "reproduce prepares the release (with its split file) once more and trains the shortlist's head on "
               "its training split, the corpus's patients dropped by the shortlist stage",
               "mistill.runbook.paper_plan",
               "the paper trains the head on the release's training notes"),
    Convention("DistiLLM-2 trainer", "App. J.3",
               "written here from the paper's equations of DistiLLM-2 (Ko et al., 2025): skew KL on the teacher's "
               "trace (preferred), skew reverse KL on the untrained student's own generation (dispreferred), at the "
               "released trainer's mixing and clipping defaults; the paper ran the trainer vendored from the "
               "official repository",
               "mistill.distill.losses.distillm2_loss",
               "the official trainer is a separate code base; the equations are what the paper reports"),
    Convention("events in the answer block", "Sec. 2.2, App. C",
               "decision events are extracted from the whole generation, the answer block after </think> included "
               "(include_answer=True)",
               "mistill.instrument.events.extract_events",
               "the paper counts every emitted code; the answer block's codes are decisions the model makes"),
    Convention("LAS simulator decoding", "App. K",
               "the simulator's prediction is greedy decoding, stopped at its answer length",
               "mistill.evaluation.las.greedy_answer",
               "the paper does not state the simulator's decoding; greedy makes a note's prediction reproducible"),
    Convention("attribution self-test scope", "Sec. 2.3, App. B, C, Table 8",
               "the first selftest_events P1 events of the first selftest_notes notes of the pass (default: "
               "every note) are checked against exact patching of every head; reproduce's HD-001 step runs the "
               "paper's ten events of one note (selftest_events=10, selftest_notes=1); no integrated-gradients row",
               "mistill.stages.characterize (attribute, selftest_events, selftest_notes)",
               "every note's first events are a deterministic, corpus-wide sample when more notes are wanted"),
    Convention("faithfulness of c: reductions", "Sec. 2.3",
               "per contrastive event the correlations over its exactly patched heads (events with at least three, "
               "non-zero margin), medians over events; pooled: each head's mean over the events that patched it, "
               "correlated across heads; the magnitude of m c as sum |m c| / sum |I| per event, median over events",
               "mistill.instrument.faithfulness",
               "the paper gives the values (0.40, 0.34 over 395 heads, 0.26) without their reductions"),
    Convention("read-side events", "Sec. 3.3, App. E",
               "the read side reads every P2 and P2C event of the notes, not only those of the faithfulness pass",
               "mistill.stages.readside.run_read_side",
               "more events per head; the faithfulness pass's subset is not a stated requirement of the readout"),
    Convention("on-policy sampling", "App. J.3",
               "the student's rollouts sample at TRL's defaults: OPD at temperature 1.0, GOLD at temperature 0.9 "
               "and top-p 0.95; one prompt per micro-step",
               "mistill.distill.onpolicy.trainer_args",
               "the paper runs both trainers at their published settings"),
    Convention("on-policy schedule", "App. J.2, J.3",
               "the recipe's own AdamW and warm-up + cosine schedule stepped by TRL, over the epochs' data orders "
               "laid end to end, the last optimizer step filled from the next epoch's order (TRL's defaults would "
               "shuffle with its own seed and warm up from zero)",
               "mistill.distill.onpolicy.on_policy_order",
               "every arm sees the same data order and schedule"),
    Convention("GOLD completion window", "App. J.3",
               "student and teacher logits from one position before the batch's earliest completion token onward "
               "(transformers' logits_to_keep); labels, ids and byte offsets cut at the same position, so the "
               "loss equals upstream's full-sequence one (a test checks it)",
               "mistill.distill.gold.completion_window_start",
               "the paper's one override: full-sequence logits of 30k-token prompts do not fit"),
    Convention("GOLD teacher input", "App. J.3",
               "the teacher reads the student's chat-templated prompt and the completion as text, re-tokenized "
               "by its own tokenizer (upstream's text-span alignment); the off-policy completion is the teacher's "
               "trace as the student's template renders it",
               "mistill.distill.gold.train_gold",
               "upstream's cross-tokenizer path; the paper changes only the logits window"),
    Convention("description words", "App. E, Table 23",
               "a word is a run of three or more letters, lower-cased; English function words and the "
               "inventory's generic qualifiers (other, unspecified, specified, site, type) never count; the "
               "matched controls draw as many distinct words as the code has distinguishing words, seeded per "
               "event, and replace every occurrence of each",
               "mistill.instrument.edits.STOPWORDS",
               "the paper's unit is the word of lower-cased running text; it does not list what a content word is"),
    Convention("edit fillers and replacement codes", "App. E, Tables 21 and 23",
               "fillers: '-', 'x', '=', '~', '*', '_' (each also after a space) repeated until the tokens are as "
               "many as the replaced text's; replacement codes: inventory codes written in the mention's shape "
               "(letters, digits, dot), in an order seeded per event",
               "mistill.instrument.edits.FILLER_UNITS",
               "the paper names the classes of replacement, not the strings"),
    Convention("mediation reads", "App. E, Table 21",
               "the mediation set is mean-ablated at the decision token only, in a second read of the identity "
               "and of every replacement", "mistill.instrument.edits.refeed_margins",
               "the paper ablates 'during each read' without naming positions; the decision token is where "
               "the heads' effect is measured everywhere else"),
    Convention("matched control keys", "App. E, Table 20",
               "whole units (other chapters' inventory lines; other codes' earlier mentions, a mention being a "
               "run of consecutive tokens) in an order seeded per event, head and key set, the last unit cut "
               "so the control blocks exactly as many keys as the named set; no control where the category "
               "holds fewer keys before the decision",
               "mistill.instrument.keyblock.matched_control",
               "the paper matches the count and the kind of unit, not how the last unit is cut"),
    Convention("matched donor event", "Sec. 2.3",
               "same kind, a different emitted choice, the same character index where one exists, "
               "else the nearest position as a fraction of the trace (ties to the lower position)",
               "mistill.instrument.passes.match_donor_event",
               "closest to 'matched'; a fraction of the whole input would be dominated by the "
               "prompt's length"),
    Convention("random sets within a bin", "App. K",
               "one random set per (seed, note, phase, k), shared by the note's events in the bin",
               "mistill.evaluation.own_heads", "reproducible"),
    Convention("calibration bookkeeping", "App. D",
               "notes without NULL events are left out of I_c; split halves seeded by note id; "
               "ties in a ranking go to the lower head index; stability splits by patient",
               "mistill.instrument.calibration",
               "deterministic rankings; no patient on both sides of a split"),
    Convention("forcing suffix A's wording", "App. F",
               "suffix A is \"\\nCode:\" (the paper names A as the pilot's weakest without its text)",
               "mistill.instrument.locus.SUFFIXES", "a short suffix that asks for a code"),
    Convention("forced letter token", "App. F",
               "the letter's token right after the suffix in the tokenization of suffix + ' ' + letter "
               "(one leading space)", "mistill.instrument.locus.forced_choice_ids",
               "the way a code follows 'is' in running text"),
    Convention("walk-back at the trace start", "App. F",
               "a margin still decisive at the trace start (closer than 512 tokens) puts the locus there, "
               "and the window / inherited rule applies", "mistill.instrument.locus.walk_back",
               "the paper stops the walk at the trace start and counts only 512-token walks as censored"),
    Convention("censored mentions' window", "App. F",
               "the attribution window of a censored mention ends 512 tokens before the letter",
               "mistill.instrument.locus_pass.attribution_locus",
               "the paper attributes its 6 censored mentions without saying where"),
    Convention("natural-margin letters", "App. F",
               "at the code token: the letter token the trace wrote, against the other inventory letters "
               "written with the same leading text", "mistill.instrument.locus_pass",
               "the same spacing variant as the emitted token, as for P1 events"),
    Convention("residual-swap donor", "App. F",
               "the nearest window-decided mention of another chapter in the same note (ties to the earlier)",
               "mistill.instrument.locus_pass", "the paper names a different-chapter window mention without "
               "saying which"),
    Convention("sustained follow-through", "App. F, Table 31",
               "the ablation sustained 'from the window all the way to the code' includes the code row",
               "mistill.instrument.window.follow_through", "the code row is where the natural margin is read"),
    Convention("random sets of passes A and B", "App. F",
               "one seeded random set per (seed, note, mention, k)", "mistill.instrument.locus_pass",
               "reproducible"),
    Convention("LAS input format", "App. K",
               "the simulator's prompt layout; F1 of an empty predicted set against an empty "
               "gold set is 1", "mistill.evaluation.las", "needed to run; the paper is silent"),
    Convention("read-side key categories", "App. E",
               "a code's chapter is its first letter; the summary header before the note counts as note; "
               "a trace token in several categories takes the later of other mentions < S < N < prefix; "
               "the near-miss's line is its own category, not one of its category's lines",
               "mistill.instrument.keycats.key_categories",
               "the paper lists the 15 categories without these boundaries; the chapter letter is "
               "the P1 decision and the region of the read side"),
    Convention("key-side blocking path", "App. E",
               "the blocked head's row is recomputed in float32 from the clean residual stream entering "
               "its layer, its output patched in and the forward continued; the empty-set reference runs "
               "in the same forward as the blocked sets", "mistill.instrument.keyblock.key_block",
               "the paper masks inside its attention kernel; recomputing one row is exact against eager "
               "attention and keeps the reference free of kernel noise"),
)
"""Rules the paper does not state that no parameter changes (the second table of the doc)."""


def config_classes() -> dict[str, type]:
    """The dataclasses a deviation's parameter may name, by class name."""
    out: dict[str, type] = {c.__name__: c for c in (ArmConfig, EdgeRule, SelectionRule, TrainingSpec)}
    for stage in stages().values():
        out[stage.config.__name__] = stage.config
    return out


def field_default(parameter: str) -> Any:
    """The default of ``<Class>.<field>`` in code (``KeyError`` when either does not exist)."""
    cls_name, name = parameter.split(".", 1)
    cls = config_classes()[cls_name]
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                return f.default_factory()  # type: ignore[misc]
            raise KeyError(f"{parameter} has no default")
    raise KeyError(f"{cls_name} has no field {name!r}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


ARM_CONVENTIONS: dict[str, str] = {"distillm2": "DistiLLM-2 trainer"}
"""An arm objective -> the :data:`CONVENTIONS` choice every run of it carries as a finding."""


def arm_conventions(arm: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conventions a train run of the resolved ``arm`` (its flags) follows where the paper ran
    other code (:data:`ARM_CONVENTIONS`): one finding each, of kind ``convention``, its
    ``parameter`` the code that implements it and its ``value`` the arm's objective."""
    choice = ARM_CONVENTIONS.get(str(arm.get("objective", "")))
    if choice is None:
        return []
    conv = next(c for c in CONVENTIONS if c.choice == choice)
    return [{"parameter": conv.where, "value": arm.get("objective"), "default": None, "paper_value": None,
             "kind": "convention"}]


def deviations_in(config_class: str, config: Mapping[str, Any], *,
                  resolved: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The registry's parameters of ``config_class`` whose value in ``config`` is not the
    platform's default or differs from the paper's stated value.

    Args:
        config_class: the class name of the run's config (``config.json``'s ``class``, last part),
            or ``ArmConfig`` for the resolved arm.
        config: the run's recorded values by field name.
        resolved: what a value that stands for another (``Deviation.resolves``, e.g. ``auto``)
            resolved to in the run, by field name; such a value is checked as its resolution, and
            is no finding where ``resolved`` does not name its field.
    Returns:
        one dict per finding: parameter, value, default, paper_value, kind (``non_default``
        when the value is not the default; ``against_paper`` when the value is the default but the
        paper states another value); for a resolved value, ``value`` is the resolution and
        ``resolved_from`` the value in ``config``.
    """
    out = []
    for d in DEVIATIONS:
        if d.class_name != config_class or d.field not in config:
            continue
        if d.when is not None and config.get(d.when[0]) not in d.when[1]:
            continue
        value = config[d.field]
        extra: dict[str, Any] = {}
        if any(_same(value, r) for r in d.resolves):
            if resolved is None or d.field not in resolved:
                continue
            extra = {"resolved_from": value}
            value = resolved[d.field]
            if d.recon or _same(value, d.paper_value):
                continue
            kind = "non_default" if not _same(extra["resolved_from"], d.default) else "against_paper"
        elif not _same(value, d.default):
            kind = "non_default"
        elif not d.recon and not _same(value, d.paper_value):
            kind = "against_paper"
        else:
            continue
        out.append({"parameter": d.parameter, "value": value, "default": d.default,
                    "paper_value": None if d.recon else d.paper_value, "kind": kind, **extra})
    return out


def _text(text: str) -> str:
    """A table cell's text: ``|`` escaped so it does not end the cell."""
    return text.replace("|", "\\|")


def _cell(value: Any) -> str:
    if isinstance(value, str) and value in (PAPER_SILENT, SET_BY_LOCK):
        return value
    if isinstance(value, (tuple, list)):
        return "`" + ", ".join(str(v) for v in value) + "`"
    return "`" + ("''" if value == "" else repr(value) if value is None else str(value)) + "`"


def markdown() -> str:
    """``docs/DEVIATIONS.md``: the registry as one table, then the fixed conventions
    (``python -m mistill.deviations > docs/DEVIATIONS.md``; a test checks the file is current)."""
    lines = [
        "# Where the platform differs from the paper",
        "",
        "Generated from `mistill/deviations.py` (`python -m mistill.deviations > docs/DEVIATIONS.md`);",
        "a test checks that this file is current and that every parameter below exists in a config.",
        "",
        "Each row is a rule a reader cannot find in the paper (**[recon]**: the paper states no value)",
        "or a place where the paper states a value, with the parameter that changes it. Every run",
        "records these values in its `config.json` (a train run also its resolved arm, under `arm`,",
        "and the values of both that differ from the defaults or the paper, under `deviations`), and the `report`",
        "lists, for the runs it reads, every value that is not the default or differs from the paper's",
        "(section \"Deviations in these runs\"), and every run tagged `mistill.deviation`.",
        "",
        "| choice | the paper (section) | the platform | parameter | default | paper's value | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in DEVIATIONS:
        paper_value = "**[recon]**" if d.recon else _cell(d.paper_value)
        lines.append(f"| {_text(d.choice)} | {_text(d.paper)} ({d.section}) | {_text(d.platform)} | "
                     f"`{d.parameter}` | {_cell(d.default)} | {paper_value} | {_text(d.why)} |")
    lines += [
        "",
        "## Conventions no parameter changes",
        "",
        "Rules the paper does not state that are fixed in code (**[recon]**); they are listed so a",
        "reader can find them, and a change to one is a change of code version.",
        "",
        "| choice | section | the platform | where | why |",
        "|---|---|---|---|---|",
    ]
    for c in CONVENTIONS:
        lines.append(f"| {_text(c.choice)} | {c.section} | {_text(c.platform)} | `{c.where}` | "
                     f"{_text(c.why)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
