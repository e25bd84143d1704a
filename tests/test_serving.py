"""The OpenAI-compatible endpoint, started for real: Ray Serve on 127.0.0.1, the bundled target, the
official `openai` client. Three applications (four with "live") share one Serve instance:

- "spec" serves the registry's champion (a random-init causal head registered in a temporary MLflow
  store, with a stored tree config) on the batched engine, so speculation is real and every greedy output
  must equal the reference decoder's, alone or with others in the batch;
- "plain" reads an empty registry: no champion, plain decoding, said so; autoscaled 1 → 2 replicas;
- "tiny" has one slot, no queue and a 2-second deadline, under the load-aware policy (given a cost curve):
  the 429, deadline and replica-death paths;
- "live" (started by the tests that use it) follows the champion of a registry of its own, polled every
  second, and wants an API key: a promotion under running streams, and auth.

Plus the parts that need no server: incremental detokenization, request and config validation.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests
import torch
from pydantic import ValidationError

from jetflow.decode import DecodeConfig, Decoder, encode_prompt
from jetflow.serving.config import ServeConfig
from jetflow.serving.engine import TextStream
from jetflow.serving.schema import ChatCompletionRequest, CompletionRequest
from jetflow.tree import TreeSpec

TARGET = "smollm2-135m"
# stored on the champion version: an algorithm with a parameter (the sweep may pick any; Serve must serve it)
TREE = TreeSpec("top2gap", 4, 3, {"margin": 1.5})
MAX_NEW = 10
CAP = 48                                                        # the apps' max_tokens
MAX_PROMPT = 200
COMMON = {"replica_cpus": 0.5, "torch_threads": 1, "max_prompt_tokens": MAX_PROMPT, "max_tokens": CAP,
          "default_max_tokens": MAX_NEW, "policy": "fixed"}
TINY_DEADLINE_S = 2.0
CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."}]
CODE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
HANG_S = 120  # a request that takes longer than this is hung, not slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str                 # http://127.0.0.1:PORT
    metrics_url: str
    logs: Path               # Ray session logs (Serve replica logs under serve/)
    champion: str            # models:/NAME/VERSION

    def client(self, app: str, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/{app}/v1", api_key=api_key, max_retries=0, timeout=HANG_S)

    def post(self, app: str, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return requests.post(f"{self.url}/{app}{path}", data=data, timeout=HANG_S,
                             headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)

    def get(self, app: str, path: str, headers: dict | None = None) -> dict:
        r = requests.get(f"{self.url}/{app}{path}", timeout=HANG_S, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()


def _register_random_champion(target, home: Path) -> str:
    """A small random-init causal head (cheap drafts: 3 depths), logged, registered, promoted to champion,
    with TREE stored."""
    from jetflow.head import DraftHead, HeadConfig, save_head
    from jetflow.tracking import (CHAMPION, log_training_run, register_head, registered_model_name, set_alias,
                                  set_tree_config)

    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=4, num_hidden_layers=1))
    folder = save_head(head, home / "heads" / "random")
    version = register_head(log_training_run(folder, TARGET, target.revision), TARGET)
    name = registered_model_name(TARGET)
    set_alias(name, CHAMPION, version, bypass_gate=True)
    set_tree_config(name, version, TREE)
    return f"models:/{name}/{version}"


@pytest.fixture(scope="module")
def served(smollm, tmp_path_factory):
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from jetflow.paths import models_dir
    from jetflow.serving.app import build_app

    home = tmp_path_factory.mktemp("jetflow_home")
    (home / "models").symlink_to(models_dir(), target_is_directory=True)  # the converted target, reused
    http_port, metrics_port = _free_port(), _free_port()
    with pytest.MonkeyPatch.context() as mp:
        # Ray's workers inherit this environment: the replicas see the temporary home and store.
        mp.setenv("JETFLOW_HOME", str(home))
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
        mp.setenv("RAY_metrics_report_interval_ms", "1000")
        mp.setenv("RAY_raylet_start_wait_time_s", "120")  # a busy 2-core machine starts Ray slowly
        mp.setenv("JETFLOW_GRAPHS_BACKEND", "aot_eager")  # the "live" app's compiled steps: dynamo's whole capture
        champion = _register_random_champion(smollm, home)
        # 3 logical CPUs for 0.5-CPU replicas: the three apps, plain's autoscaled second replica and a test's
        # extra app all fit at once (with 2, the extra app's replica waited for plain to scale back down).
        ctx = ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
                       _metrics_export_port=metrics_port)  # the tests read the replicas' log files
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
            from jetflow.engine.cost import StepCostCurve

            curve = StepCostCurve("test", 100, (1, 2), (1, 4), ((40.0, 60.0), (50.0, 80.0))).save(home / "curve.json")
            serve.run_many([
                RunTarget(build_app(COMMON), name="spec", route_prefix="/spec"),
                RunTarget(build_app({**COMMON, "tracking_uri": f"sqlite:///{home / 'empty.db'}", "max_replicas": 2,
                                     "target_ongoing_requests": 1, "upscale_delay_s": 0}),
                          name="plain", route_prefix="/plain"),
                RunTarget(build_app({**COMMON, "max_slots": 1, "max_queued_requests": 0, "policy": "auto",
                                     "cost_curve": str(curve), "request_timeout_s": TINY_DEADLINE_S}),
                          name="tiny", route_prefix="/tiny"),
            ])
            yield Served(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics",
                         Path(ctx.address_info["session_dir"]) / "logs", champion)
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def ar(smollm):
    return Decoder(smollm)


def greedy(decoder: Decoder, prompt, raw: bool = False, max_new: int = MAX_NEW, stop=()):
    return decoder.generate(prompt, DecodeConfig(max_new_tokens=max_new, stop=list(stop)), raw=raw)


# ------------------------------------------------------------------------- the champion, speculative


@pytest.mark.slow
def test_models_lists_the_target_served_with_the_champion_head_and_its_stored_tree(served):
    (card,) = served.client("spec").models.list().data
    assert card.id == TARGET
    info = card.model_extra["jetflow"]
    assert info["speculative"] is True and info["head"] == served.champion
    assert info["tree"] == TREE.to_dict() and info["note"] is None


@pytest.mark.slow
def test_chat_completion_greedy_is_identical_to_the_decoder(served, ar):
    reply = served.client("spec").chat.completions.create(model=TARGET, messages=CHAT, max_tokens=MAX_NEW,
                                                          temperature=0)
    ref = greedy(ar, CHAT)
    assert reply.choices[0].message.content == ref.text
    assert reply.choices[0].finish_reason == ref.finish_reason
    assert reply.usage.completion_tokens == len(ref.token_ids)
    assert reply.usage.prompt_tokens == ref.stats.prompt_tokens
    stats = reply.usage.model_extra["jetflow"]
    assert stats["speculative"] is True and stats["head"] == served.champion and stats["tree"] == TREE.to_dict()
    assert stats["rounds"] >= 1 and stats["tau"] == pytest.approx(len(ref.token_ids) / stats["rounds"], abs=1e-3)


@pytest.mark.slow
def test_completion_feeds_the_raw_prompt_and_is_identical_to_the_decoder(served, ar):
    reply = served.client("spec").completions.create(model=TARGET, prompt=CODE, max_tokens=MAX_NEW, temperature=0)
    ref = greedy(ar, CODE, raw=True)
    assert reply.choices[0].text == ref.text
    assert reply.usage.completion_tokens == len(ref.token_ids) == MAX_NEW
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_streaming_chat_concatenates_to_the_decoders_greedy_output_and_ends_with_usage(served, ar):
    stream = served.client("spec").chat.completions.create(model=TARGET, messages=CHAT, max_tokens=MAX_NEW,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True})
    chunks = list(stream)
    ref = greedy(ar, CHAT)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(ref.token_ids)
    assert usage.model_extra["jetflow"]["speculative"] is True


@pytest.mark.slow
def test_streamed_completion_with_a_stop_string_matches_the_unstreamed_cut(served, ar):
    ref = greedy(ar, CODE, raw=True, max_new=16)
    stop = ref.text[len(ref.text) // 2:][:3]     # a string the greedy continuation reaches mid-way
    assert stop and stop in ref.text
    cut = greedy(ar, CODE, raw=True, max_new=16, stop=[stop])
    client = served.client("spec")
    whole = client.completions.create(model=TARGET, prompt=CODE, max_tokens=16, temperature=0, stop=stop)
    parts = list(client.completions.create(model=TARGET, prompt=CODE, max_tokens=16, temperature=0, stop=stop,
                                           stream=True))
    assert whole.choices[0].text == cut.text == "".join(p.choices[0].text for p in parts)
    assert stop not in cut.text and whole.choices[0].finish_reason == "stop" == parts[-1].choices[0].finish_reason


# ------------------------------------------------------------------------- logprobs, echo, batches (lm-eval's)


def _sse_events(r: requests.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ") and line != b"data: [DONE]"]


def _whole_forward(target, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, V) log-probabilities of ids[1:] from one causal forward (HF's own model)."""
    with torch.inference_mode():
        return torch.log_softmax(target.model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


@pytest.mark.slow
def test_completion_logprobs_are_the_targets_raw_ones_at_each_token_streamed_or_not(served, ar, smollm):
    ref = ar.generate(CODE, DecodeConfig(max_new_tokens=MAX_NEW, logprobs=2), raw=True)  # plain: the reference
    body = {"model": TARGET, "prompt": CODE, "max_tokens": MAX_NEW, "temperature": 0.8, "seed": 3, "logprobs": 2}
    sampled = served.post("spec", "/v1/completions", body).json()["choices"][0]  # speculative, sampled
    lp = sampled["logprobs"]
    ids = smollm.tokenizer.encode(CODE)
    tokens = [smollm.tokenizer.encode(t, add_special_tokens=False) for t in lp["tokens"]]  # ASCII code: one each
    assert all(len(t) == 1 for t in tokens)
    tokens = [t[0] for t in tokens]
    raw = _whole_forward(smollm, ids + tokens)[len(ids) - 1:]
    assert len(lp["token_logprobs"]) == len(tokens) == MAX_NEW
    assert lp["token_logprobs"] == pytest.approx([raw[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
    assert all(len(top) <= 3 and lp["tokens"][i] in top for i, top in enumerate(lp["top_logprobs"]))
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == sampled["text"]
    greedy_body = {**body, "temperature": 0}
    whole = served.post("spec", "/v1/completions", greedy_body).json()["choices"][0]
    assert whole["text"] == ref.text
    assert whole["logprobs"]["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    parts = _sse_events(served.post("spec", "/v1/completions", {**greedy_body, "stream": True}, stream=True))
    streamed = {k: [x for p in parts if p["choices"][0]["logprobs"] for x in p["choices"][0]["logprobs"][k]]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == whole["logprobs"]


@pytest.mark.slow
def test_chat_logprobs_with_top_logprobs_streamed_or_not(served, ar):
    ref = ar.generate(CHAT, DecodeConfig(max_new_tokens=MAX_NEW, logprobs=3))
    body = {"model": TARGET, "messages": CHAT, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    reply = served.client("spec").chat.completions.create(**body)
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == ref.text
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    for c, e in zip(content, ref.logprobs):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in e.top], abs=1e-4)
    assert bytes(b for c in content for b in c.bytes).decode() == "".join(c.token for c in content)
    assert "".join(c.token for c in content).startswith(ref.text)
    chunks = list(served.client("spec").chat.completions.create(**body, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    plain = served.client("spec").chat.completions.create(model=TARGET, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompts_logprobs_first_null_as_lm_eval_reads_them(served, smollm, max_tokens):
    ids = smollm.tokenizer.encode(CODE)
    body = {"model": TARGET, "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0, "seed": 1234}                                  # lm-eval's loglikelihood request
    reply = served.post("spec", "/v1/completions", body).json()
    (choice,) = reply["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and choice["text"].startswith(CODE)
    whole = _whole_forward(smollm, ids)
    assert lp["token_logprobs"][1: len(ids)] == pytest.approx([whole[i, t].item() for i, t in enumerate(ids[1:])],
                                                               abs=1e-4)
    assert reply["usage"]["completion_tokens"] == max_tokens and reply["usage"]["jetflow"]["rounds"] == 1
    streamed = _sse_events(served.post("spec", "/v1/completions", {**body, "stream": True}, stream=True))
    assert "".join(p["choices"][0]["text"] for p in streamed if p["choices"]) == choice["text"]
    assert [x for p in streamed if p["choices"] and p["choices"][0]["logprobs"]
            for x in p["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]


@pytest.mark.slow
def test_a_batch_of_prompts_is_answered_in_index_order_each_as_it_is_alone(served, smollm):
    prompts = [CODE, "Once upon a time", "1, 2, 3,"]
    common = {"model": TARGET, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    alone = [served.post("spec", "/v1/completions", {**common, "prompt": p}).json()["choices"][0] for p in prompts]
    for batch in (prompts, [smollm.tokenizer.encode(p) for p in prompts]):
        reply = served.post("spec", "/v1/completions", {**common, "prompt": batch}).json()
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
        assert [c["text"] for c in reply["choices"]] == [a["text"] for a in alone]
        for c, a in zip(reply["choices"], alone):
            assert c["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-4)
        assert reply["usage"]["completion_tokens"] == 18
    parts = _sse_events(served.post("spec", "/v1/completions", {**common, "prompt": prompts, "stream": True},
                                    stream=True))
    texts = ["", "", ""]
    for p in parts:
        for c in p["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [a["text"] for a in alone]
    r = served.post("tiny", "/v1/completions", {**common, "prompt": ["a", "b"]})   # one slot, no queue: never fits
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.slow
def test_bad_logprob_requests_leave_a_running_stream_untouched(served, ar):
    stream = _open_stream(served, "spec", 24)
    events = stream.iter_lines()
    first = next(events)
    for path, body, status, _ in BAD_LOGPROB_REQUESTS.values():
        assert served.post("spec", path, body).status_code == status
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in [first, *events]
                   if line.startswith(b"data: {") and json.loads(line[6:])["choices"])
    assert text == greedy(ar, CHAT, max_new=24).text


@pytest.mark.slow
def test_the_tokenizer_routes_lm_eval_probes_answer_as_vllms_do(served, smollm):
    tok = smollm.tokenizer
    info = served.get("spec", "/tokenizer_info")
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    ids = served.post("spec", "/tokenize", {"prompt": CODE, "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode(CODE, add_special_tokens=False) and ids["count"] == len(ids["tokens"])
    chat = served.post("spec", "/tokenize", {"model": TARGET, "messages": CHAT}).json()["tokens"]
    assert chat == encode_prompt(tok, CHAT)
    assert served.post("spec", "/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": CODE}
    bad = served.post("spec", "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ------------------------------------------------------------------------- no champion


@pytest.mark.slow
def test_without_a_champion_it_serves_plain_decoding_and_says_so_everywhere(served, ar):
    client = served.client("plain")
    (card,) = client.models.list().data
    info = card.model_extra["jetflow"]
    assert info["speculative"] is False and info["head"] is None and "no champion" in info["note"]
    reply = client.chat.completions.create(model=TARGET, messages=CHAT, max_tokens=MAX_NEW, temperature=0)
    stats = reply.usage.model_extra["jetflow"]
    assert stats["speculative"] is False and stats["note"] == info["note"] and stats["tau"] == 1.0
    assert reply.choices[0].message.content == greedy(ar, CHAT).text
    assert "no champion" in _replica_log_line(served, "plain", "WITHOUT speculation")   # said at start


# ------------------------------------------------------------------------- bad input → 4xx, OpenAI body

GOOD = {"model": TARGET, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_LOGPROB_REQUESTS = {  # logprobs, echo and the prompt shapes lm-eval sends
    "logprobs above 5": ("/v1/completions", {"model": TARGET, "prompt": "x", "logprobs": 6}, 400, "logprobs"),
    "logprobs negative": ("/v1/completions", {"model": TARGET, "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    "top_logprobs above 20": ("/v1/chat/completions", {**GOOD, "logprobs": True, "top_logprobs": 21}, 400,
                              "top_logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {**GOOD, "top_logprobs": 2}, 400, "top_logprobs"),
    "empty token list": ("/v1/completions", {"model": TARGET, "prompt": []}, 400, "prompt"),
    "empty token list in a batch": ("/v1/completions", {"model": TARGET, "prompt": [[1, 2], []]}, 400, "prompt"),
    "texts and token ids in one batch": ("/v1/completions", {"model": TARGET, "prompt": [[1, 2], "a"]}, 400,
                                         "prompt"),
    "echo past the context": ("/v1/completions", {"model": TARGET, "prompt": "word " * (2 * MAX_PROMPT), "echo": True,
                                                  "logprobs": 1, "max_tokens": 1}, 400, "prompt"),
    "max_tokens 0 without echo": ("/v1/completions", {"model": TARGET, "prompt": "x", "max_tokens": 0}, 400,
                                  "max_tokens"),
    "a batch past the replica": ("/v1/completions", {"model": TARGET, "prompt": ["a"] * 200}, 400, "prompt"),
}
BAD_REQUESTS = {
    "malformed JSON": ("/v1/chat/completions", '{"model": "smollm2-135m", "messages": [', 400, None),
    "not an object": ("/v1/chat/completions", "[1, 2]", 400, None),
    "empty body": ("/v1/chat/completions", "", 400, None),
    "missing messages": ("/v1/chat/completions", {"model": TARGET}, 400, "messages"),
    "empty messages": ("/v1/chat/completions", {**GOOD, "messages": []}, 400, "messages"),
    "bad role": ("/v1/chat/completions", {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, 400,
                 "messages.0.role"),
    "unknown model": ("/v1/chat/completions", {**GOOD, "model": "gpt-9"}, 404, "model"),
    "temperature too high": ("/v1/chat/completions", {**GOOD, "temperature": 2.5}, 400, "temperature"),
    "temperature negative": ("/v1/completions", {"model": TARGET, "prompt": "x", "temperature": -1}, 400,
                             "temperature"),
    "top_p zero": ("/v1/chat/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    "top_p above one": ("/v1/completions", {"model": TARGET, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    "max_tokens over the cap": ("/v1/chat/completions", {**GOOD, "max_tokens": CAP + 1}, 400, "max_tokens"),
    "max_tokens zero": ("/v1/chat/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    "prompt too long": ("/v1/completions", {"model": TARGET, "prompt": "word " * (2 * MAX_PROMPT)}, 400, "prompt"),
    "prompt too long, streaming": ("/v1/chat/completions", {**GOOD, "stream": True, "messages": [
        {"role": "user", "content": "word " * (2 * MAX_PROMPT)}]}, 400, "messages"),
    "unknown parameter": ("/v1/chat/completions", {**GOOD, "best_of": 3}, 400, "best_of"),
    "n > 1": ("/v1/chat/completions", {**GOOD, "n": 2}, 400, "n"),
    "token id out of vocab": ("/v1/completions", {"model": TARGET, "prompt": [1, 10**9]}, 400, "prompt"),
    **BAD_LOGPROB_REQUESTS,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_a_4xx_with_the_openai_error_body(served, case):
    path, body, status, param = BAD_REQUESTS[case]
    r = served.post("spec", path, body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and len(err["message"]) > 10
    assert err["param"] == param


@pytest.mark.slow
def test_the_openai_client_raises_its_own_typed_errors(served):
    client = served.client("spec")
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match=f"limit of {CAP}"):
        client.chat.completions.create(model=TARGET, messages=CHAT, max_tokens=1000)
    r = requests.get(f"{served.url}/spec/v1/nothing-here", timeout=HANG_S)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# ------------------------------------------------------------------------- slow and vanished clients


def _open_stream(served: Served, app: str, max_tokens: int, rid: str = "") -> requests.Response:
    body = {**GOOD, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    r = served.post(app, "/v1/chat/completions", body, stream=True, headers={"x-request-id": rid} if rid else {})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    return r


def _active(served: Served, app: str) -> int:
    return served.get(app, "/healthz")["active"]


def _replica_log_line(served: Served, app: str, needle: str, every_s: float = 0.5) -> str:
    """The first line of `app`'s replica logs containing `needle` (waits, bounded, for the log flush)."""
    deadline = time.monotonic() + 30
    while True:
        for path in (served.logs / "serve").glob(f"replica_{app}_*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if needle in line:
                    return line
        if time.monotonic() > deadline:
            return ""
        time.sleep(every_s)


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_others_are_served(served):
    rid = f"jetflow-gone-{time.time_ns()}"
    r = _open_stream(served, "spec", CAP, rid)
    first = next(r.iter_lines())                 # generation is under way ...
    assert first.startswith(b"data: ")
    r.close()                                    # ... and the client goes away
    line = _replica_log_line(served, "spec", f"chat {rid} closed by the client after")
    assert line, "the replica never noticed the disconnect"
    assert int(line.split("after ")[1].split()[0]) < CAP   # it stopped generating early
    deadline = time.monotonic() + HANG_S
    while _active(served, "spec") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _active(served, "spec") == 0
    reply = served.client("spec").completions.create(model=TARGET, prompt=CODE, max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


@pytest.mark.slow
def test_a_slow_streaming_client_does_not_block_other_requests(served):
    slow = _open_stream(served, "spec", CAP)
    lines = slow.iter_lines()
    next(lines)                                  # read one event, then stop reading while others are served
    try:
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda p: served.client("spec").completions.create(
                model=TARGET, prompt=p, max_tokens=4, temperature=0), ["def add(a, b):", "import os\n"]))
        assert [r.usage.completion_tokens for r in replies] == [4, 4]
        assert _active(served, "spec") >= 1      # the slow stream is still open and generating
        rest = b"".join(lines)                   # and it still completes when its reader comes back
        assert rest.endswith(b"data: [DONE]")
    finally:
        slow.close()


@pytest.mark.slow
def test_eight_concurrent_greedy_requests_are_batched_and_each_gets_the_text_it_gets_alone(served, ar):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    alone = [greedy(ar, [{"role": "user", "content": p}], max_new=16).text for p in prompts]  # = jetflow generate
    peak = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak.append(_active(served, "spec"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda p: served.client("spec").chat.completions.create(
                model=TARGET, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0), prompts))
    finally:
        done.set()
        watcher.join()
    assert [r.choices[0].message.content for r in replies] == alone
    assert max(peak) >= 2, "the requests were never in the engine's batch together"
    health = served.get("spec", "/healthz")  # what its steps ran: the stored tree (policy fixed; plain steps are
    steps = health["decode_steps_by_budget"]  # other tests' requests that asked for no tree)
    assert health["policy"] == "fixed" and steps.get(str(TREE.budget), 0) >= 4 and set(steps) <= {"1", str(TREE.budget)}


@pytest.mark.slow
def test_a_full_replica_answers_429_with_the_openai_error_body(served):
    """While the one slot holds a long generation, a request gets 429 with OpenAI's body, and the OpenAI client
    raises RateLimitError. The occupant meets the app's 2-second deadline on a loaded machine, so the two requests
    count only where it is still running after them (then it ran throughout); else the scenario is run again."""
    for _ in range(3):
        free_by = time.monotonic() + HANG_S
        while _active(served, "tiny") and time.monotonic() < free_by:  # an earlier occupant leaves first
            time.sleep(0.2)
        slow = _open_stream(served, "tiny", CAP)       # the one slot: a long generation under way
        try:
            deadline = time.monotonic() + TINY_DEADLINE_S
            while not _active(served, "tiny") and time.monotonic() < deadline:
                time.sleep(0.02)
            if not _active(served, "tiny"):
                continue
            r = served.post("tiny", "/v1/chat/completions", {**GOOD, "max_tokens": 2})
            try:
                served.client("tiny").chat.completions.create(model=TARGET, messages=CHAT, max_tokens=2)
                raised = None
            except openai.RateLimitError as exc:
                raised = exc
            if not _active(served, "tiny"):  # the occupant left (its deadline) before the requests were done
                continue
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "retry later" in err["message"]
            assert raised is not None and raised.status_code == 429
            return
        finally:
            slow.close()
    pytest.fail("the slot's occupant never outlived two requests: the replica is too slow to test a full slot")


@pytest.mark.slow
def test_a_request_past_its_deadline_gets_504_and_the_next_one_is_served(served):
    # a generation far longer than TINY_DEADLINE_S on this CPU (48 tokens at several tokens per second)
    deadline = time.monotonic() + HANG_S
    while _active(served, "tiny") and time.monotonic() < deadline:  # the previous test's stream left
        time.sleep(0.2)
    t0 = time.monotonic()
    counting = {"model": TARGET, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": CAP, "temperature": 0}
    r = served.post("tiny", "/v1/completions", counting)  # counting on: no early stop
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout" and "request_timeout_s" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < TINY_DEADLINE_S + 30
    reply = served.client("tiny").completions.create(model=TARGET, prompt=CODE, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2     # the slot was freed


@pytest.mark.slow
def test_a_non_streaming_client_that_gives_up_frees_its_slot(served):
    import http.client
    from urllib.parse import urlsplit

    rid = f"jetflow-gave-up-{time.time_ns()}"
    url = urlsplit(served.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=HANG_S)
    conn.request("POST", "/spec/v1/chat/completions", json.dumps({**GOOD, "messages": CHAT, "max_tokens": CAP,
                                                                   "temperature": 0}),
                 headers={"content-type": "application/json", "x-request-id": rid})
    # its first tokens are out (logged with its prompt's length) and CAP tokens take > 1 s: it is generating ...
    assert _replica_log_line(served, "spec", f"chat {rid}: ", every_s=0.02)
    assert _active(served, "spec") == 1
    conn.sock.shutdown(socket.SHUT_RDWR)                                  # ... and the client goes away
    conn.close()
    line = _replica_log_line(served, "spec", f"chat {rid} closed by the client after")
    assert line, "the replica never noticed the disconnect"
    assert int(line.split("after ")[1].split()[0]) < CAP                  # it stopped generating early
    deadline = time.monotonic() + HANG_S
    while _active(served, "spec") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _active(served, "spec") == 0


@pytest.mark.slow
def test_killing_a_replica_mid_request_gives_the_client_an_error_and_serve_replaces_it(served):
    import os
    import signal

    from ray import serve

    pid = served.get("tiny", "/healthz")["pid"]
    stream = _open_stream(served, "tiny", CAP)
    lines = stream.iter_lines()
    next(lines)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    rest = b""
    try:
        rest = b"".join(lines)                      # the stream ends (truncated) instead of hanging
    except requests.exceptions.RequestException:
        pass
    assert time.monotonic() - t0 < HANG_S and not rest.endswith(b"data: [DONE]")
    deadline = time.monotonic() + 3 * HANG_S
    while time.monotonic() < deadline:
        try:
            if served.get("tiny", "/healthz")["pid"] != pid:
                break
        except (AssertionError, requests.exceptions.RequestException):
            pass
        time.sleep(1)
    state = serve.status().applications["tiny"].deployments["JetFlow"].replica_states
    assert state.get("RUNNING") == 1, state
    assert served.client("tiny").completions.create(model=TARGET, prompt=CODE, max_tokens=2,
                                                    temperature=0).usage.completion_tokens == 2


# ------------------------------------------------------------------------- load, autoscaling, ids, metrics


@pytest.mark.slow
def test_concurrent_load_loses_no_request_and_autoscaling_adds_a_replica(served):
    from ray import serve

    def replicas() -> dict:
        return dict(serve.status().applications["plain"].deployments["JetFlow"].replica_states)

    seen: list[dict] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(replicas())
            time.sleep(0.5)

    def ask(i: int):
        return served.client("plain").chat.completions.create(
            model=TARGET, messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}], max_tokens=4,
            temperature=0)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, range(32)))
        # the autoscaler acts on ongoing requests averaged over its look-back window: the second
        # replica may come up just after the last reply; wait for it (bounded), well before downscaling
        deadline = time.monotonic() + HANG_S
        while not (seen and seen[-1].get("RUNNING", 0) >= 2) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        done.set()
        watcher.join()
    assert len(replies) == 32 and len({r.id for r in replies}) == 32
    assert all(r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1 for r in replies)
    assert seen[0].get("RUNNING") == 1 and seen[-1].get("RUNNING") == 2, seen


@pytest.mark.slow
def test_a_replica_that_cannot_read_the_registry_does_not_start_and_says_why(served):
    """A registry out of reach (a tracking server down, or not reachable from the replica's node) fails the
    replica with the reason, and Serve reports the application failed — never a replica serving plain decoding
    unannounced. The healthy applications beside it keep serving."""
    from ray import serve

    from jetflow.serving.app import build_app

    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="noregistry failed"):
        serve.run(build_app({**COMMON, "tracking_uri": dead}), name="noregistry", route_prefix="/noregistry")
    try:
        assert time.monotonic() - t0 < HANG_S
        status = serve.status().applications["noregistry"]
        assert status.status == "DEPLOY_FAILED"
        message = status.deployments["JetFlow"].message  # what Serve (and `serve status`) reports
        assert "registry lookup" in message and dead in message and "does not start" in message, message
    finally:
        serve.delete("noregistry")
    assert requests.get(f"{served.url}/spec/v1/models", timeout=30).status_code == 200


def test_a_request_id_is_echoed_and_carried_through_the_replica_log(served):
    rid = f"jetflow-test-{time.time_ns()}"
    r = served.post("spec", "/v1/chat/completions", {**GOOD, "temperature": 0}, headers={"x-request-id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid and r.json()["id"] == f"chatcmpl-{rid}"
    assert _replica_log_line(served, "spec", f"chat {rid} done: ")


@pytest.mark.slow
def test_prometheus_exports_tau_tokens_per_s_and_latency(served):
    served.client("spec").completions.create(model=TARGET, prompt=CODE, max_tokens=4, temperature=0)
    wanted = ("ray_jetflow_tau_count", "ray_jetflow_decode_tokens_per_s_count", "ray_jetflow_request_latency_s_count",
              "ray_jetflow_requests_total")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = requests.get(served.metrics_url, timeout=HANG_S).text
        if all(w in text for w in wanted):
            break
        time.sleep(1)
    missing = [w for w in wanted if w not in text]
    assert not missing, missing
    spec_tau = [ln for ln in text.splitlines() if ln.startswith("ray_jetflow_tau_count") and 'speculative="true"' in ln]
    assert spec_tau and float(spec_tau[0].rsplit(" ", 1)[1]) >= 1


# ------------------------------------------------------------------------- no server needed


@pytest.mark.slow
def test_text_stream_deltas_concatenate_to_the_final_text_and_hold_back_stop_prefixes(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("Hello wörld — naïve café 日本語 END tail", add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=True)
    stream = TextStream(tok, stop=["END"])
    out = "".join(stream.update([t]) for t in ids)  # one new token at a time, as the engine commits them
    final = text[: text.find("END")]
    assert "\ufffd" not in out and final.startswith(out)
    assert out + stream.finish(final) == final
    held = TextStream(tok, stop=["Hello there"])
    assert held.update(tok.encode("Hello", add_special_tokens=False)) == ""   # could still become the stop


def test_requests_are_validated_like_openai_does():
    ok = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "developer", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "stop": "x"})
    assert ok.chat() == [{"role": "system", "content": "ab"}] and ok.stop == ["x"] and ok.temperature == 1.0
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["only one"]}).prompts == ["only one"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts == [[1, 2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    lm_eval = CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6]], "temperature": 0, "max_tokens": 1,
                                                "logprobs": 1, "seed": 1234, "echo": True})   # its loglikelihood
    assert lm_eval.echo and lm_eval.logprobs == 1 and lm_eval.prompts == [[5, 6]]
    echo_only = CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True, "max_tokens": 0})
    assert echo_only.max_tokens == 0
    for bad in ({"model": "m", "prompt": ""}, {"model": "m", "prompt": []}, {"model": "m", "prompt": [[1], []]},
                {"model": "m", "prompt": ["a", [1]]}, {"model": "m", "prompt": [True]},
                {"model": "m", "prompt": "x", "logprobs": 6}, {"model": "m", "prompt": "x", "max_tokens": 0},
                {"model": "m", "prompt": "x", "suffix": "y"},
                {"model": "m", "prompt": "x", "presence_penalty": 0.5}, {"model": "m", "prompt": "x", "stop": [""]},
                {"model": "m", "prompt": "x", "stop": list("abcde")}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)


def test_serve_config_refuses_inconsistent_or_unknown_settings():
    cfg = ServeConfig.model_validate({"budget": "8", "max_replicas": "2"})   # `serve run` k=v strings
    assert cfg.tree == TreeSpec(budget=8)
    assert ServeConfig.model_validate(cfg.model_dump()) == cfg              # what a replica receives
    assert ServeConfig.model_validate({"tree": TREE.to_dict()}).tree == TREE  # serve/config.yaml's form
    for bad in ({"min_replicas": 3, "max_replicas": 2}, {"default_max_tokens": 600}, {"budget": 0},
                {"algorithm": "no-such-tree"}, {"replicas": 2}, {"tree": {"budget": 8}, "width": 3}):
        with pytest.raises(ValidationError):
            ServeConfig.model_validate(bad)


def test_a_missing_head_fails_when_the_app_is_built_not_in_a_replica(tmp_path):
    from jetflow.errors import HeadNotFoundError
    from jetflow.serving.app import build_app

    with pytest.raises(HeadNotFoundError, match="no head"):
        build_app({"head": str(tmp_path / "nope")})


def test_backend_vllm_without_vllm_stops_serve_with_one_line_before_ray_starts(capsys, monkeypatch):
    """The main .venv never has vLLM (its CPU build lives in .venv-vllm): `backend: vllm` there says so in one line,
    with what to run instead, before any Ray or replica exists. (With vLLM: tests/test_vllm_cpu.py.)"""
    import runpy

    from jetflow.errors import VllmUnavailableError
    from jetflow.serving.app import build_app
    from jetflow.vllm import vllm_available

    if vllm_available():
        pytest.skip("vLLM is importable here: tests/test_vllm_cpu.py covers backend vllm")
    with pytest.raises(VllmUnavailableError) as err:
        build_app({"backend": "vllm", "head": "none"})
    message = str(err.value)
    assert "\n" not in message and ".venv-vllm/bin/python" in message and "make setup-vllm" in message
    assert "backend: jetflow" in message
    main = runpy.run_path(str(Path(__file__).parents[1] / "serve" / "app.py"), run_name="under_test")["main"]
    assert main(["--backend", "vllm", "--head", "none", "--port", str(_free_port())]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("serve: error: backend: vllm needs vLLM"), lines


def test_the_deploy_config_validates_against_ray_and_our_schema():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((Path(__file__).parents[1] / "serve" / "config.yaml").read_text())
    ServeDeploySchema.model_validate(doc)
    assert doc["http_options"]["host"] == "127.0.0.1"
    (app,) = doc["applications"]
    assert app["import_path"] == "jetflow.serving.app:build_app"
    cfg = ServeConfig.model_validate(app["args"])
    assert cfg.head is None and cfg.alias == "champion" and cfg.max_replicas > cfg.min_replicas
    assert cfg.backend == "jetflow"


# ------------------------------------------------------------------------- a live champion, an API key

LIVE_KEY = "sk-jetflow-test-7c1e0f3a9b2d4e65"
LIVE_AUTH = {"authorization": f"Bearer {LIVE_KEY}"}
LIVE_POLL_S = 1.0
LIVE_MAX = 80                        # tokens of a stream that outlasts a promotion's pick-up (~1.3 s here)
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy counting goes on: no early stop


@dataclass
class Live:
    store: str                       # the "live" app's own registry (so "spec"'s champion stays put)
    name: str                        # its registered model
    versions: tuple[str, str]        # v1 (champion at start), v2


def _register_random_version(target, folder: Path, seed: int) -> str:
    from jetflow.head import DraftHead, HeadConfig, save_head
    from jetflow.tracking import log_training_run, register_head

    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.for_target(target, block_size=4, num_hidden_layers=1))
    return register_head(log_training_run(save_head(head, folder / f"head-{seed}"), TARGET, target.revision), TARGET)


@pytest.fixture(scope="module")
def live(served, smollm, tmp_path_factory):
    from ray import serve

    from jetflow.serving.app import build_app
    from jetflow.tracking import CHAMPION, registered_model_name, set_alias, set_tree_config

    folder = tmp_path_factory.mktemp("live_registry")
    store = f"sqlite:///{folder / 'mlflow.db'}"
    name = registered_model_name(TARGET)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", store)
        versions = tuple(_register_random_version(smollm, folder, seed) for seed in (1, 2))
        for v in versions:
            set_tree_config(name, v, TREE)
        set_alias(name, CHAMPION, versions[0], bypass_gate=True)
    serve.run(build_app({**COMMON, "tracking_uri": store, "champion_poll_s": LIVE_POLL_S, "api_key": LIVE_KEY,
                         "max_tokens": LIVE_MAX, "graphs": "compile"}), name="live", route_prefix="/live")
    try:
        yield Live(store, name, versions)
    finally:
        serve.delete("live")


def _promote(live: Live, version: str) -> None:
    from jetflow.tracking import CHAMPION, set_alias

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", live.store)
        set_alias(live.name, CHAMPION, version, bypass_gate=True)


@pytest.mark.slow
def test_a_promotion_reaches_the_running_replica_and_streams_under_way_finish_on_their_head(served, live, ar):
    """Compiled steps (graphs=compile): while the new head's engine is built and its draft graph compiled, beside
    the running engine, the streams under way keep flowing and lose no token — each is the target's greedy text."""
    v1, v2 = live.versions
    client = served.client("live", api_key=LIVE_KEY)
    info = client.models.list().data[0].model_extra["jetflow"]
    assert info["head_version"] == v1 and info["follows"] == {"alias": "champion", "poll_s": LIVE_POLL_S}
    health = served.get("live", "/healthz")
    assert health["graphs"] == "compile" and health["graphs_ready"] is True
    finished: dict[int, list] = {}

    def stream(i: int) -> None:
        finished[i] = list(client.completions.create(model=TARGET, prompt=COUNTING, max_tokens=LIVE_MAX,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + HANG_S
        while served.get("live", "/healthz")["active"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        steps_before = served.get("live", "/healthz")["steps"]
        _promote(live, v2)
        t0 = time.monotonic()
        while client.models.list().data[0].model_extra["jetflow"]["head_version"] != v2:
            assert time.monotonic() - t0 < HANG_S, "the replica never picked the new champion up"
            time.sleep(0.1)
        picked_up_s = time.monotonic() - t0
        health = served.get("live", "/healthz")
        assert not finished and health["active"] == 2 and health["engines"] == 2, (finished, health)
        assert health["steps"] > steps_before  # the running streams stepped on while the new engine was built
    finally:
        for t in threads:
            t.join(HANG_S)
    assert picked_up_s < LIVE_POLL_S + 30
    expected = greedy(ar, COUNTING, raw=True, max_new=LIVE_MAX).text
    for chunks in finished.values():                  # the streams under way: complete, all on v1, no token lost
        usage = chunks[-1].usage
        assert chunks[-2].choices[0].finish_reason == "length" and usage.completion_tokens == LIVE_MAX
        assert usage.model_extra["jetflow"]["head_version"] == v1
        assert usage.model_extra["jetflow"]["head"] == f"models:/{live.name}/{v1}"
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    later = client.completions.create(model=TARGET, prompt=CODE, max_tokens=4, temperature=0)
    stats = later.usage.model_extra["jetflow"]
    assert stats["head_version"] == v2 and stats["head"] == f"models:/{live.name}/{v2}" and stats["speculative"]
    assert served.get("live", "/healthz")["engines"] == 1     # the old engine went once its requests ended
    assert _replica_log_line(served, "live", f"now serving head models:/{live.name}/{v2}")


@pytest.mark.slow
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-wrong"}, {"authorization": LIVE_KEY}],
                         ids=["missing", "wrong", "not bearer"])
def test_a_request_without_the_api_key_gets_openais_401_body_before_anything_else(served, live, headers):
    for method, path, body in (("POST", "/v1/chat/completions", {**GOOD, "max_tokens": 2}),
                               ("POST", "/v1/completions", "{not json"),   # refused before the body is read
                               ("GET", "/v1/models", None)):
        r = requests.request(method, f"{served.url}/live{path}", timeout=HANG_S,
                             data=body if isinstance(body, str) or body is None else json.dumps(body),
                             headers={"content-type": "application/json", **headers})
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["param"] is None
        assert "API key" in err["message"] and LIVE_KEY not in err["message"]


@pytest.mark.slow
def test_with_an_api_key_healthz_stays_open_the_key_serves_and_no_log_holds_it(served, live):
    assert served.get("live", "/healthz")["status"] == "ok"                      # no key: a probe's route
    with pytest.raises(openai.AuthenticationError):
        served.client("live", api_key="sk-wrong").models.list()
    slow = served.post("live", "/v1/completions", {"model": TARGET, "prompt": COUNTING, "max_tokens": 32,
                                                    "temperature": 0, "stream": True}, stream=True, headers=LIVE_AUTH)
    try:
        assert slow.status_code == 200
        lines = slow.iter_lines()
        next(lines)
        for _ in range(3):                                     # refused requests beside a running stream ...
            assert served.post("live", "/v1/completions", {"model": TARGET, "prompt": "x"}).status_code == 401
        assert b"".join(lines).endswith(b"data: [DONE]")       # ... leave it alone
    finally:
        slow.close()
    reply = served.client("live", api_key=LIVE_KEY).completions.create(model=TARGET, prompt=CODE, max_tokens=2)
    assert reply.usage.completion_tokens == 2
    time.sleep(1)                                              # the replicas' log flush
    leaked = [str(p) for p in served.logs.rglob("*") if p.is_file() and LIVE_KEY.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_the_api_key_never_shows_in_the_configs_repr_dump_or_errors(monkeypatch):
    from jetflow.serving.auth import key_from_env

    cfg = ServeConfig.model_validate({"api_key": LIVE_KEY})
    assert cfg.api_key.get_secret_value() == LIVE_KEY
    assert ServeConfig.model_validate(cfg.model_dump()) == cfg                   # what a replica receives
    for text in (repr(cfg), str(cfg), json.dumps(cfg.model_dump(mode="json"))):
        assert LIVE_KEY not in text
    with pytest.raises(ValidationError) as err:
        ServeConfig.model_validate({"api_key": LIVE_KEY, "min_replicas": 3, "max_replicas": 2})
    assert LIVE_KEY not in str(err.value)
    monkeypatch.setenv("JETFLOW_API_KEY", LIVE_KEY)
    assert key_from_env(ServeConfig()).api_key.get_secret_value() == LIVE_KEY
    assert key_from_env(cfg.model_copy(update={"api_key": None})).api_key.get_secret_value() == LIVE_KEY
    monkeypatch.delenv("JETFLOW_API_KEY")
    assert key_from_env(ServeConfig()).api_key is None


@pytest.mark.parametrize("host, key, warns", [("0.0.0.0", None, True), ("10.0.0.5", None, True), ("::", None, True),
                                              ("0.0.0.0", LIVE_KEY, False), ("127.0.0.1", None, False),
                                              ("localhost", None, False), ("::1", None, False)])
def test_serve_warns_at_start_when_it_binds_a_reachable_address_without_a_key(host, key, warns, tmp_path, capsys,
                                                                                monkeypatch):
    import runpy

    monkeypatch.delenv("JETFLOW_API_KEY", raising=False)
    if key:
        monkeypatch.setenv("JETFLOW_API_KEY", key)
    main = runpy.run_path(str(Path(__file__).parents[1] / "serve" / "app.py"), run_name="under_test")["main"]
    code = main(["--host", host, "--head", str(tmp_path / "nope")])   # stops at the missing head, before Ray
    err = capsys.readouterr().err
    assert code == 2 and "no head" in err
    assert ("serve: warning: binding" in err and "JETFLOW_API_KEY" in err) is warns, err
    assert LIVE_KEY not in err
