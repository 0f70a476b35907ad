"""Generation backends: HF on tiny models (seeded, capped, recorded decoding), the vLLM settings
mapping without vLLM installed, and the clear error when vLLM is asked for but missing."""

from __future__ import annotations

import subprocess
import sys

from gen_fixtures import scripted_model
from mistill.evaluation.backends import (Backend, HFBackend, make_backend, rope_scaling_of,
                                         vllm_engine_kwargs, vllm_sampling_kwargs)
from mistill.evaluation.generation import DecodingConfig
from mistill.evaluation.parsing import parse_answer

SCRIPT = ' violet stapler hummed</think>["B27"]'


def _prompt(backend) -> str:
    return backend.tokenizer.apply_chat_template([{"role": "user", "content": "Code: chest pain."}],
                                                 tokenize=False, add_generation_prompt=True)


def test_hf_backend_seeded_reproducible_and_records_decoding():
    dec = DecodingConfig(max_new_tokens=10, seed=3)
    backend = make_backend("hf", "tiny:qwen3", dec)
    assert isinstance(backend, HFBackend) and isinstance(backend, Backend) and backend.name == "hf"
    prompt = _prompt(backend)
    a, b = backend.generate(prompt, 11), backend.generate(prompt, 11)
    c = backend.generate(prompt, 12)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids
    assert a.seed == 11 and c.seed == 12
    assert a.decoding == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 10,
                          "seed": 3, "backend": "hf", "rope_scaling": None}
    many = backend.generate_many([(prompt, 11), (prompt, 12)])
    assert [g.token_ids for g in many] == [a.token_ids, c.token_ids]


def test_hf_backend_cap_flag_and_scripted_answer(tmp_path):
    path = scripted_model(tmp_path / "scripted", SCRIPT)
    full = make_backend("hf", str(path), DecodingConfig(max_new_tokens=64))
    gen = full.generate(_prompt(full), 1)
    assert gen.text == SCRIPT and not gen.capped and gen.n_tokens == len(gen.token_ids)
    ans = parse_answer(gen.text, ["B27", "A01.1"], capped=gen.capped)
    assert ans.valid and ans.codes == ("B27",)
    short = make_backend("hf", str(path), DecodingConfig(max_new_tokens=3))
    cut = short.generate(_prompt(short), 1)
    assert cut.capped and cut.n_tokens == 3 and cut.decoding["max_new_tokens"] == 3
    assert not parse_answer(cut.text, ["B27"], capped=cut.capped).valid


def test_vllm_sampling_kwargs_map_the_decoding():
    dec = DecodingConfig(temperature=0.7, top_p=0.9, top_k=30, max_new_tokens=512, seed=4)
    kw = vllm_sampling_kwargs(dec, 12345)
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["top_k"] == 30
    assert kw["max_tokens"] == 512 and kw["seed"] == 12345 and kw["n"] == 1
    assert kw["stop"] == [] and kw["ignore_eos"] is False  # never cut at </think>
    paper = vllm_sampling_kwargs(DecodingConfig(), 0)
    assert (paper["temperature"], paper["top_p"], paper["top_k"], paper["max_tokens"]) == (0.6, 0.95, 20, 16384)


def test_vllm_engine_kwargs_pass_yarn_through():
    from transformers import Qwen3Config

    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 40960}
    cfg = Qwen3Config(rope_scaling=dict(yarn), max_position_embeddings=81920)
    kw = vllm_engine_kwargs("/models/student", cfg, dtype="bfloat16", seed=7)
    rope = kw["hf_overrides"]["rope_scaling"]
    assert {k: rope[k] for k in yarn} == yarn
    assert kw["max_model_len"] == 81920 and kw["model"] == "/models/student" and kw["seed"] == 7
    assert kw["dtype"] == "bfloat16"
    # a plain config.json dict works too, and an explicit window wins
    kw2 = vllm_engine_kwargs("m", {"rope_scaling": yarn, "max_position_embeddings": 40960},
                             max_model_len=50000)
    assert kw2["hf_overrides"]["rope_scaling"] == yarn and kw2["max_model_len"] == 50000
    # no YaRN: no override, the native window
    plain = vllm_engine_kwargs("m", Qwen3Config(max_position_embeddings=40960))
    assert "hf_overrides" not in plain and plain["max_model_len"] == 40960
    assert rope_scaling_of(Qwen3Config()) is None


def test_backends_module_imports_without_vllm():
    code = ("import sys; import mistill.evaluation.backends as b; "
            "assert 'vllm' not in sys.modules; print(b.BACKENDS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "vllm" in out.stdout


def test_vllm_backend_without_vllm_says_install_the_extra():
    """Run where vLLM cannot be imported (a subprocess that blocks the module), so the check runs
    on every machine, the suite's own (which installs vLLM) included."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from mistill.errors import MistillInputError\n"
            "from mistill.evaluation.backends import make_backend, resolve_backend\n"
            "from mistill.evaluation.generation import DecodingConfig\n"
            "assert resolve_backend('auto', 'cpu') == 'hf'\n"
            "try:\n"
            "    make_backend('vllm', 'tiny:qwen3', DecodingConfig())\n"
            "except MistillInputError as err:\n"
            "    assert 'mistill[vllm]' in str(err) and err.field == 'backend', err\n"
            "else:\n"
            "    raise AssertionError('no error without vLLM')\n"
            "try:\n"
            "    make_backend('onnx', 'tiny:qwen3', DecodingConfig())\n"
            "except MistillInputError as err:\n"
            "    assert 'unknown backend' in str(err), err\n"
            "print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr[-2000:]