"""lm-evaluation-harness as a real client of the Serve endpoint. A small local task set built from the bundled
HumanEval problems (written at test time): a multiple-choice task (which function name fits the docstring's first
sentence: loglikelihood requests, `echo` + `logprobs` + `max_tokens: 1` on token-id prompts, sent in batches of 4),
a generate_until task (the signature after `def name(`, through `local-completions`) and a chat generation task
(through `local-chat-completions`). The endpoint serves the bundled target speculatively (a random head) and plainly;
lm-eval's own HF backend (`--model hf` on the same folder) is the reference: the same accuracy, the same per-item
log-likelihoods to fp32 tolerance, the same generations.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TARGET = "smollm2-135m"
LL_TOL = 1e-4            # nats per item: chunked, batched prefill vs one HF forward, in fp32
RUNNER = Path(__file__).with_name("lm_eval_runs.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tasks(folder: Path) -> Path:
    """Three lm-eval tasks (YAML + JSONL) from HumanEval's problems: jetflow_names (multiple choice, 8 items),
    jetflow_signature (generate_until: the first argument's name, 4), jetflow_chat (chat generation, 3)."""
    from jetflow.data.prompts import _humaneval_problems

    folder.mkdir(parents=True, exist_ok=True)
    problems = _humaneval_problems()[:20]

    def first_sentence(p: dict) -> str:
        doc = re.split(r'"""|\'\'\'', p["prompt"])[1]
        return re.split(r"(?<=\.)\s|>>>", " ".join(doc.split()))[0].strip()

    items = [{"sentence": first_sentence(p), "name": p["entry_point"],
              "args": next(line for line in p["prompt"].splitlines()
                           if line.startswith(f"def {p['entry_point']}(")).split("(", 1)[1]} for p in problems]
    mc = []
    for j, it in enumerate(items[:8]):  # the right name and three others, the right one at place j % 4
        others = [items[(j + k) % len(items)]["name"] for k in (5, 10, 15)]
        mc.append({"sentence": it["sentence"], "choices": others[: j % 4] + [it["name"]] + others[j % 4:],
                   "label": j % 4})

    def table(name: str, rows: list[dict]) -> str:
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
                "test_split: test\n")

    (folder / "jetflow_names.yaml").write_text(table("jetflow_names", mc) + (
        'output_type: multiple_choice\ndoc_to_text: "# {{sentence}}\\ndef"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"))
    generation = ("output_type: generate_until\ngeneration_kwargs:\n  until: {until}\n  max_gen_toks: {n}\n"
                  "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
                  "    higher_is_better: true\n")
    (folder / "jetflow_signature.yaml").write_text(table("jetflow_signature", items[8:12]) + (  # the first argument
        'doc_to_text: "# {{sentence}}\\ndef {{name}}("\ndoc_to_target: "{{args.split(\':\')[0]}}"\n'
        "filter_list:\n  - name: first_word\n    filter:\n      - function: regex\n"
        '        regex_pattern: "(\\\\w+)"\n      - function: take_first\n')
        + generation.format(until='["\\n"]', n=16))
    (folder / "jetflow_chat.yaml").write_text(table("jetflow_chat", items[12:15]) + (
        'doc_to_text: "Name a Python function that does this: {{sentence}} Answer with the name only."\n'
        'doc_to_target: "{{name}}"\n') + generation.format(until="[]", n=12))
    return folder


def _runner_env(tmp: Path) -> dict:
    return {**os.environ, "HF_DATASETS_CACHE": str(tmp / "hf_datasets"), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _start_runs(tmp: Path, name: str, tasks: Path, runs: dict) -> tuple[subprocess.Popen, Path]:
    spec, out = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec.write_text(json.dumps({"include_path": str(tasks), "runs": runs}))
    proc = subprocess.Popen([sys.executable, str(RUNNER), str(spec), str(out)], env=_runner_env(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> dict:
    log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def evaluations(smollm, tmp_path_factory):
    """lm-eval's HF backend on the bundled target's folder (started first, in its own process, while Ray and Serve
    start), then lm-eval against the endpoint's speculative and plain apps → {run: its results}."""
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from jetflow.paths import models_dir
    from jetflow.serving.app import build_app

    tmp = tmp_path_factory.mktemp("lm_eval")
    tasks = write_tasks(tmp / "tasks")
    folder = models_dir() / TARGET
    hf = _start_runs(tmp, "hf", tasks, {
        "hf": {"model": "hf", "model_args": f"pretrained={folder},dtype=float32",
               "tasks": ["jetflow_names", "jetflow_signature"]},
        "hf_chat": {"model": "hf", "model_args": f"pretrained={folder},dtype=float32", "tasks": ["jetflow_chat"],
                    "apply_chat_template": True}})
    home = tmp / "jetflow_home"
    home.mkdir()
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    port = _free_port()
    common = {"replica_cpus": 0.5, "torch_threads": 1, "max_prompt_tokens": 512, "max_tokens": 64,
              "default_max_tokens": 16, "policy": "fixed", "champion_poll_s": 0}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JETFLOW_HOME", str(home))
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
        mp.setenv("RAY_raylet_start_wait_time_s", "120")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run_many([
                RunTarget(build_app({**common, "head": "random", "budget": 4}), name="spec", route_prefix="/spec"),
                RunTarget(build_app({**common, "head": "none"}), name="plain", route_prefix="/plain")])
            url = f"http://127.0.0.1:{port}"

            def completions(app: str, batch: int) -> dict:
                # as README's command; tokenizer_backend auto-detects the endpoint's /tokenize (remote)
                return {"model": "local-completions", "tasks": ["jetflow_names", "jetflow_signature"],
                        "model_args": f"model={TARGET},base_url={url}/{app}/v1/completions,num_concurrent=2,"
                                      f"batch_size={batch},max_retries=1"}

            def chat(app: str) -> dict:
                return {"model": "local-chat-completions", "tasks": ["jetflow_chat"], "apply_chat_template": True,
                        "model_args": f"model={TARGET},base_url={url}/{app}/v1/chat/completions,num_concurrent=3,"
                                      "max_retries=1"}

            endpoint = _finish(*_start_runs(tmp, "endpoint", tasks, {
                "spec": completions("spec", 4), "plain": completions("plain", 1),
                "spec_chat": chat("spec"), "plain_chat": chat("plain")}))
        except BaseException:
            hf[0].kill()
            raise
        finally:
            serve.shutdown()
            ray.shutdown()
    results = {**endpoint, **_finish(*hf)}
    for name, run in results.items():  # lm-eval's own tables, for the run log (BENCHMARKS.md)
        print(f"\n[{name}]\n{run['table']}")
    return results


@pytest.mark.slow
def test_lm_eval_scores_the_endpoint_as_its_own_hf_backend_scores_the_model(evaluations):
    hf = evaluations["hf"]
    for app in ("spec", "plain"):
        run = evaluations[app]
        assert run["metrics"]["jetflow_names"]["acc,none"] == hf["metrics"]["jetflow_names"]["acc,none"]
        worst = 0.0
        for doc, choices in hf["items"]["jetflow_names"].items():
            got = run["items"]["jetflow_names"][doc]
            for (ll, greedy), ((ll_hf, greedy_hf),) in zip([c[0] for c in got], choices):
                worst = max(worst, abs(float(ll) - float(ll_hf)))
                assert abs(float(ll) - float(ll_hf)) < LL_TOL, (app, doc, ll, ll_hf)
                assert str(greedy) == str(greedy_hf)
        print(f"{app}: largest per-item |log-likelihood - hf's| {worst:.2e} over {len(hf['items']['jetflow_names'])} "
              "items x 4 choices")
        # generation: the champion-style speculative app and the plain one both give HF's greedy text
        assert run["items"]["jetflow_signature"] == hf["items"]["jetflow_signature"], app
        assert run["metrics"]["jetflow_signature"] == hf["metrics"]["jetflow_signature"]


@pytest.mark.slow
def test_lm_eval_chat_generations_through_the_endpoint_are_hf_s_with_its_chat_template(evaluations):
    hf = evaluations["hf_chat"]["items"]["jetflow_chat"]
    assert evaluations["spec_chat"]["items"]["jetflow_chat"] == hf
    assert evaluations["plain_chat"]["items"]["jetflow_chat"] == hf
    assert all(r[0][0].strip() for r in hf.values())   # real text, not empty answers
