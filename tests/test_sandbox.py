"""The execution sandbox of the programming tasks' pass@1 (App. P): one terminal verdict per
program, the limits enforced, no network, nothing left behind."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mistill.evaluation.sandbox import (ISOLATION, OUTCOMES, SandboxLimits, pass_at_1, run_program, run_programs)
from mistill.tasks.bigcodebench import execute, load_bigcodebench, program

TESTS = textwrap.dedent('''
    import unittest

    class TestCases(unittest.TestCase):
        def test_sum(self):
            self.assertEqual(task_func([1, 2, 3]), 6)

        def test_empty(self):
            self.assertEqual(task_func([]), 0)
''')
FAST = SandboxLimits(timeout_s=20.0, memory_mb=1024)


def run(code: str, limits: SandboxLimits = FAST):
    return run_program(f"{code}\n{TESTS}" if code else code, task_id="t", limits=limits)


def test_passing_failing_and_broken_programs_get_their_verdicts():
    passed = run("def task_func(xs):\n    return sum(xs)\n")
    assert passed.outcome == "passed" and passed.passed and passed.returncode == 0
    assert passed.isolation in ISOLATION
    wrong = run("def task_func(xs):\n    return len(xs)\n")
    assert wrong.outcome == "failed" and not wrong.passed and "test_sum" in wrong.detail
    raising = run("def task_func(xs):\n    raise ValueError('no')\n")
    assert raising.outcome == "failed"
    assert run("def task_func(xs)\n    return 0\n").outcome == "error"  # a syntax error
    assert run("import a_module_that_is_not_installed\n").outcome == "error"
    no_tests = run_program("x = 1\n", limits=FAST)
    assert no_tests.outcome == "error" and "no tests" in no_tests.detail
    assert run_program("   \n", limits=FAST).outcome == "no_code" and run_program(None).outcome == "no_code"
    # a program that ends the process itself never reports a pass, whatever its exit status
    assert run("import sys\nsys.exit(0)\n").outcome == "error"
    quits = run("import os\ndef task_func(xs):\n    os._exit(0)\n")
    assert quits.outcome == "error" and quits.returncode == 0


def test_the_limits_end_a_program_with_a_verdict():
    slow = run("import time\ndef task_func(xs):\n    time.sleep(30)\n",
               limits=SandboxLimits(timeout_s=1.5, memory_mb=1024))
    assert slow.outcome == "timeout" and slow.returncode is None and slow.seconds < 15
    big = run("def task_func(xs):\n    block = bytearray(2 * 1024 ** 3)\n    return sum(xs)\n",
              limits=SandboxLimits(timeout_s=20.0, memory_mb=512))
    assert big.outcome == "memory"
    with pytest.raises(ValueError):
        SandboxLimits(timeout_s=0)


@pytest.mark.parametrize("netns", [True, False], ids=["namespace-if-available", "guard-only"])
def test_no_network_no_environment_and_a_clean_folder_removed_afterwards(netns, monkeypatch):
    import mistill.evaluation.sandbox as sandbox

    if not netns:  # the guard alone, as on a machine that refuses unprivileged namespaces
        monkeypatch.setattr(sandbox, "network_namespace_available", lambda: False)
    monkeypatch.setenv("MISTILL_SANDBOX_CANARY", "secret")
    probe = textwrap.dedent('''
        import os, socket, sys, unittest

        class TestCases(unittest.TestCase):
            def test_world(self):
                print("cwd=" + os.getcwd(), file=sys.stderr)
                self.assertNotIn("MISTILL_SANDBOX_CANARY", os.environ)
                self.assertEqual(sorted(os.listdir(".")), ["harness.py", "program.py"])
                self.assertEqual(os.path.realpath(os.environ["HOME"]), os.path.realpath(os.getcwd()))
                with self.assertRaises(OSError):
                    socket.create_connection(("127.0.0.1", 9), timeout=2)
                with self.assertRaises(OSError):
                    socket.socket().connect(("127.0.0.1", 9))
                with open("left.txt", "w") as fh:
                    fh.write("x")
    ''')
    verdict = sandbox.run_program(probe, limits=FAST)
    assert verdict.outcome == "passed", verdict.detail
    assert verdict.isolation == ("socket-guard" if not netns else verdict.isolation)
    folder = next(line for line in verdict.detail.splitlines() if line.startswith("cwd="))[len("cwd="):]
    assert "mistill-sandbox-" in folder and not Path(folder).exists()


def test_bigcodebench_answers_run_with_their_tests_one_verdict_each(tmp_path):
    problems = [{"task_id": f"BigCodeBench/{i}", "complete_prompt": "def task_func(xs):\n", "instruct_prompt": "Sum.",
                 "canonical_solution": "    return sum(xs)\n", "code_prompt": "def task_func(xs):\n",
                 "test": TESTS, "entry_point": "task_func", "libs": "[]"} for i in range(4)]
    path = tmp_path / "bcb.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    loaded = load_bigcodebench(path)
    right = "<think>sum them</think>\n```python\ndef task_func(xs):\n    return sum(xs)\n```"
    wrong = "<think>count</think>\n```python\ndef task_func(xs):\n    return len(xs)\n```"
    assert program(loaded[0], "<think>no code</think> just words") is None
    assert program(loaded[0], right).endswith(TESTS + "\n")
    verdicts = execute(loaded, {"BigCodeBench/0": right, "BigCodeBench/1": wrong, "BigCodeBench/2": "no block"},
                       limits=FAST)
    assert [v.task_id for v in verdicts] == [p["task_id"] for p in problems]
    assert [v.outcome for v in verdicts] == ["passed", "failed", "no_code", "no_code"]
    assert all(v.outcome in OUTCOMES for v in verdicts)
    assert pass_at_1(verdicts) == 0.25 and pass_at_1([]) != pass_at_1([])
    assert [v.outcome for v in run_programs([("a", None)])] == ["no_code"]
