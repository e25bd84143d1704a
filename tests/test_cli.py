"""`jetflow` command line, run as a user runs it (a subprocess): JSON output, losslessness against plain
AR, JSONL prompt files, one-line errors with exit code 2, and `prepare-model`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from jetflow import cli
from jetflow.target import TargetModel
from jetflow.target.bundled import MANIFEST, bundled_dir
from tests.conftest import tiny_target

PROMPT = "Name three primary colors."
MAX_NEW = 8


# One intra-op thread: on a small shared machine, OpenMP threads spinning against other work make a
# few-token generation several times slower; the outputs checked here do not depend on thread count.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def jetflow(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jetflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def json_lines(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str, last_line_only: bool = False) -> str:
    """Exit 2, no traceback, nothing on stdout, and ONE `jetflow: error:` line naming `fragments`."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    if not last_line_only:
        assert len(lines) == 1, result.stderr
    line = lines[-1]
    assert line.startswith("jetflow: error: "), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def assert_argument_error(result: subprocess.CompletedProcess, option: str) -> None:
    """argparse's own refusal of an argument's type or range: exit 2, usage plus its `error:` line."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("jetflow generate: error: argument " + option), last


# ------------------------------------------------------------------- generation (real model)
@pytest.fixture(scope="module")
def speculative() -> subprocess.CompletedProcess:
    return jetflow("generate", "--json", "--head", "random", "--budget", "8", "--max-new-tokens", str(MAX_NEW),
                   PROMPT, timeout=180)


@pytest.fixture(scope="module")
def autoregressive_file(tmp_path_factory) -> subprocess.CompletedProcess:
    """No head (plain AR) over a JSONL file: line 1 is PROMPT as 'prompt', line 2 the same user turn as 'messages'."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": PROMPT}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": PROMPT}]}) + "\n")
    return jetflow("generate", "--json", "--max-new-tokens", str(MAX_NEW), "--prompts", str(path), timeout=180)


@pytest.mark.slow
def test_generate_json_prints_one_object_with_text_tokens_and_timed_stats(speculative):
    from transformers import AutoTokenizer

    (out,) = json_lines(speculative)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    ids = out["token_ids"]
    assert 1 <= len(ids) <= MAX_NEW and all(isinstance(t, int) for t in ids)
    assert out["finish_reason"] in ("length", "stop")
    assert out["finish_reason"] == "stop" or len(ids) == MAX_NEW
    # token_ids are the generated tokens only, and `text` is their decoding
    tokenizer = AutoTokenizer.from_pretrained(bundled_dir("smollm2-135m"))
    assert out["text"] and out["text"] == tokenizer.decode(ids, skip_special_tokens=True)

    stats = out["stats"]
    assert stats["new_tokens"] == len(ids)
    assert 1 <= stats["rounds"] <= len(ids)
    assert stats["tau"] == pytest.approx(len(ids) / stats["rounds"], abs=1e-4)
    times = stats["time_s"]
    assert all(times[phase] >= 0 for phase in ("draft", "tree", "verify", "accept"))
    assert times["draft"] > 0 and times["verify"] > 0  # the head drafted, the target verified
    assert times["draft"] + times["tree"] + times["verify"] + times["accept"] <= times["decode"] + 1e-3


@pytest.mark.slow
def test_generate_with_random_head_is_token_identical_to_autoregressive(speculative, autoregressive_file):
    spec, = json_lines(speculative)
    ar = json_lines(autoregressive_file)[0]  # the same PROMPT, decoded without a head
    assert spec["token_ids"] == ar["token_ids"]
    assert spec["text"] == ar["text"]


@pytest.mark.slow
def test_generate_prompts_file_prints_one_json_line_per_prompt(autoregressive_file):
    from_prompt, from_messages = json_lines(autoregressive_file)
    for out in (from_prompt, from_messages):
        assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
        assert 1 <= len(out["token_ids"]) <= MAX_NEW
        assert out["stats"]["tau"] == 1.0  # no head: one token per target forward
    # a 'prompt' is one user turn, so the equivalent 'messages' decode the same way
    assert from_prompt["token_ids"] == from_messages["token_ids"]


# ------------------------------------------------------------------------------- errors
# The entry point itself (exit status, stderr, no traceback) is checked through a subprocess; the other
# user errors go through the same `main(argv)` in-process, which spares a 3-4 s torch import per case.
def jetflow_in_process(capfd, *args: str) -> subprocess.CompletedProcess:
    """`main(argv)` as `python -m jetflow.cli` runs it (`sys.exit(main())`), with fd-level capture."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["jetflow", *args], code, out, err)


@pytest.fixture
def no_target_load(monkeypatch):
    """Fail the test if the CLI loads a target: these inputs must be refused before that."""
    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the input was validated")

    monkeypatch.setattr(TargetModel, "load", no_load)


def test_unknown_model_exits_2_with_one_error_line_and_no_traceback():
    # a bare name (not org/name), so the hub client prints no retry warnings first
    line = assert_user_error(jetflow("generate", "--model", "no-such-model", PROMPT), "no-such-model",
                             last_line_only=True)
    assert "cannot load target" in line


@pytest.mark.parametrize("option, message", [("--budget", "budget must be an integer in 1..4096"),
                                             ("--width", "width must be an integer in 1..1024"),
                                             ("--max-new-tokens", "max_new_tokens must be >= 1")])
def test_zero_budget_width_or_length_exits_2_in_one_line(capfd, no_target_load, option, message):
    assert_user_error(jetflow_in_process(capfd, "generate", option, "0", PROMPT), message)


@pytest.mark.parametrize("option, value, message", [("--dtype", "float8", "dtype must be one of"),
                                                    ("--device", "tpu", "device must be auto, cpu, cuda")])
def test_an_unknown_device_or_dtype_exits_2_before_loading_the_target(capfd, no_target_load, option, value, message):
    assert_user_error(jetflow_in_process(capfd, "generate", option, value, PROMPT), message)


def test_device_and_dtype_reach_the_target_load(capfd, monkeypatch):
    """`--device/--dtype` place the target (the head follows it): a published head on a GPU machine."""
    import torch

    from jetflow.errors import UnknownModelError

    seen = {}

    def load(name, device="cpu", dtype=torch.float32):
        seen.update(name=name, device=device, dtype=dtype)
        raise UnknownModelError("stop here")

    monkeypatch.setattr(TargetModel, "load", load)
    jetflow_in_process(capfd, "generate", "--model", "some/model", "--device", "cpu", "--dtype", "bfloat16", PROMPT)
    assert seen == {"name": "some/model", "device": torch.device("cpu"), "dtype": torch.bfloat16}


def test_a_non_integer_budget_is_refused_by_the_argument_parser():
    assert_argument_error(jetflow("generate", "--budget", "eight", PROMPT), "--budget")


def test_a_bare_boolean_flag_leaves_the_prompt_to_the_prompt_argument(capfd, monkeypatch):
    monkeypatch.setattr(cli, "cmd_generate", lambda args: print(f"{args.prompt!r} {args.json}") or 0)
    assert jetflow_in_process(capfd, "generate", "--json", "What is 2+2?").stdout == "'What is 2+2?' True\n"
    assert jetflow_in_process(capfd, "generate", "--json", "false", "hi").stdout == "'hi' False\n"
    assert jetflow_in_process(capfd, "generate", "--no-json", "hi").stdout == "'hi' False\n"
    refused = jetflow_in_process(capfd, "generate", "--json", "yes please", "hi")  # no PROMPT slot left for it
    assert refused.returncode == 2 and "expected true/false" in refused.stderr


def test_missing_head_path_exits_2_before_loading_the_target(capfd, tmp_path, no_target_load):
    missing = tmp_path / "no-head"
    assert_user_error(jetflow_in_process(capfd, "generate", "--head", str(missing), PROMPT), "no head", str(missing))


def test_missing_prompts_file_exits_2(capfd, tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert_user_error(jetflow_in_process(capfd, "generate", "--prompts", str(missing)), str(missing),
                      "does not exist")


def test_malformed_jsonl_exits_2_naming_the_line(capfd, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + '{"prompt": "unterminated\n')
    assert_user_error(jetflow_in_process(capfd, "generate", "--prompts", str(path)), f"{path}:2:",
                      "not valid JSON")


def test_jsonl_line_without_prompt_or_messages_exits_2_naming_the_line(capfd, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + json.dumps({"question": "where?"}) + "\n")
    assert_user_error(jetflow_in_process(capfd, "generate", "--prompts", str(path)), f"{path}:3:",
                      "'prompt'", "'messages'")


def test_unknown_tree_algorithm_exits_2_listing_the_known_ones(capfd):
    assert_user_error(jetflow_in_process(capfd, "generate", "--algorithm", "beam", PROMPT), "'beam'",
                      "accum_logp", "chain")


@pytest.mark.parametrize("value", ["-0.5", "-1", "inf", "nan"])
def test_negative_or_non_finite_temperature_exits_2(capfd, value):
    assert_user_error(jetflow_in_process(capfd, "generate", "--temperature", value, PROMPT), "temperature")


def test_prompt_and_prompts_file_together_or_neither_exit_2(capfd, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    assert_user_error(jetflow_in_process(capfd, "generate", "--prompts", str(path), PROMPT), "not both")
    assert_user_error(jetflow_in_process(capfd, "generate"), "no prompt")


@pytest.mark.parametrize("messages", [["hi"], [{"role": "user"}], [{"content": "hi"}]],
                         ids=["strings", "no-content", "no-role"])
def test_jsonl_messages_that_are_not_chat_messages_exit_2_naming_the_line(capfd, tmp_path, no_target_load,
                                                                           messages):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"messages": messages}) + "\n")
    assert_user_error(jetflow_in_process(capfd, "generate", "--prompts", str(path)), f"{path}:2:")


def test_empty_stop_string_exits_2(capfd, no_target_load):
    # an empty stop string matches any text: generation would stop after one token with text ""
    assert_user_error(jetflow_in_process(capfd, "generate", "--stop", "", PROMPT), "stop")


def test_head_folder_that_is_not_a_head_exits_2(capfd, tmp_path, monkeypatch):
    target = tiny_target("qwen3")
    monkeypatch.setattr(TargetModel, "load", lambda *args, **kwargs: target)
    target.model.save_pretrained(tmp_path / "a-model")  # config.json + model.safetensors, not a head
    assert_user_error(jetflow_in_process(capfd, "generate", "--head", str(tmp_path / "a-model"), PROMPT),
                      str(tmp_path / "a-model"))


# -------------------------------------------------------------------------- prepare-model
@pytest.mark.slow
def test_prepare_model_prints_the_model_folder_and_is_idempotent():
    first = jetflow("prepare-model", "smollm2-135m", timeout=600)
    assert first.returncode == 0, first.stderr
    folder = bundled_dir("smollm2-135m")
    assert first.stdout.strip() == str(folder)
    assert (folder / MANIFEST).is_file() and (folder / "config.json").is_file()
    weights = folder / "model.safetensors"
    written = weights.stat().st_mtime_ns

    started = time.perf_counter()
    second = jetflow("prepare-model", "smollm2-135m")
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == str(folder)
    assert weights.stat().st_mtime_ns == written  # not converted again
    assert time.perf_counter() - started < 30
