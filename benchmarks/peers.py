"""JetFlow beside the engines its users would run instead, back to back on one machine: vLLM (AR, and DFlash chain
speculation with an exported head), llama.cpp (AR) and JetFlow (plain, and the champion's serving setting), in
process and through their OpenAI endpoints, on the same held-out prompts, chat template and token budget, at 1
client (requests one after another) and N concurrent clients (default 8). Run it on a quiet machine.

    make llama-cpp setup-vllm                                # the peers, once (llama.cpp ~6 min, vLLM ~3 min)
    python benchmarks/peers.py --vllm-head ~/.jetflow/exports/demo-vllm      # every part
    python benchmarks/peers.py --parts llamacpp,jetflow --prompts 2          # a quick look

Parts (--parts, in this order; each row one at a time, nothing else of the harness running beside it):
- vllm: vLLM AR and (with --vllm-head, a folder written by `jetflow export --to vllm`) its DFlash chain, each in a
  process of the vLLM venv's python (benchmarks/peers_vllm.py: `vllm.LLM(model=DIR, dtype="float32")`; N clients
  = one `generate` of every prompt with `max_num_seqs` N);
- vllm-serve: the same two through vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`);
- llamacpp: llama.cpp's `llama-server -t THREADS -np N -c 8192 --jinja` on the fp32 GGUF of the same weights
  (`make llama-cpp`), and its `llama-bench` decode speed at 1 and THREADS threads;
- jetflow: plain decoding and the champion's serving setting in this process (`decoder_for` at 1 client, an
  `Engine` of N slots at N; `--graphs`, default auto; policy fixed);
- serve: the same two through our endpoint, `serve/app.py` as `make serve` starts it (plain: `--head none`).

Every endpoint gets the same token ids on `/v1/completions` (our chat template applied here: identical prompt
tokens by construction, and the server's `usage.prompt_tokens` checked against them), `temperature 0`,
`max_tokens`, prompt caching off. N clients = N threads, each sending its next prompt when its last one
returned. Tokens/s = generated tokens (as each engine counts them) / wall seconds, prefill included. Outputs are
compared token by token with the reference row (vLLM AR in process if it ran, else JetFlow plain in process):
the first differing position per prompt (for text-only endpoints, the first reference token their text leaves).
Beside the rows, the weight-read floor: the target's weight bytes / this host's streaming read bandwidth
(a 512 MB fp32 tensor summed, as ../shared/calibration/bandwidth.py does), on 1 and THREADS threads, this run.

Writes peers.json and peers.md under --out (default $JETFLOW_HOME/bench/peers/) after every part.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

# benchmarks/ is on sys.path when this runs as a script
from peers_report import LLAMA_AR, VLLM_AR, add_ratios, compare_outputs, floor_figures, markdown

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m"
PARTS = ("vllm", "vllm-serve", "llamacpp", "jetflow", "serve")


# ------------------------------------------------------------------------------------------ host
def host_info() -> dict:
    def run(*cmd) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout.strip()

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "unknown"
    dirty = bool(run("git", "status", "--porcelain", "--untracked-files=no"))
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu, "cores": os.cpu_count(),
            "commit": run("git", "rev-parse", "--short", "HEAD") + ("+dirty" if dirty else ""),
            "loadavg_start": os.getloadavg(), "busy_start": busy_processes()}


def busy_processes(min_cpu: float = 5.0, window_s: float = 2.0) -> list[str]:
    """What else is running: other processes over `min_cpu` % of one core during the next `window_s` seconds."""
    import psutil

    procs = [pr for pr in psutil.process_iter(["pid", "name", "cmdline"]) if pr.pid != os.getpid()]
    for pr in procs:
        try:
            pr.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(window_s)
    busy = []
    for pr in procs:
        try:
            pct = pr.cpu_percent(None)
            if pct >= min_cpu:
                cmd = " ".join(pr.info["cmdline"] or [pr.info["name"]])
                busy.append((pct, f"pid {pr.pid}, {pct:.0f} %: {cmd[:120]}"))
        except psutil.Error:
            pass
    return [line for _, line in sorted(busy, reverse=True)]


BANDWIDTH = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.ones(128 * 1024 * 1024)  # 512 MB of fp32
for _ in range(2):
    a.sum()
t = time.perf_counter()
for _ in range(5):
    a.sum()
print(a.numel() * 4 / ((time.perf_counter() - t) / 5) / 1e9)
"""


def measure_floor(threads: list[int]) -> dict:
    """The weight-read floor of the target on this host, now: its weight bytes (safetensors headers) and the
    streaming read bandwidth at each thread count, each in a fresh process."""
    from jetflow.vllm.regenerate import model_source

    weight_bytes = 0
    for f in Path(model_source(TARGET)).glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        weight_bytes += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                            if k != "__metadata__")
    gbs = {t: float(subprocess.run([sys.executable, "-c", BANDWIDTH, str(t)], capture_output=True, text=True,
                                   check=True).stdout.strip()) for t in threads}
    return {"weight_bytes": weight_bytes, "threads": floor_figures(weight_bytes, gbs)}


# ------------------------------------------------------------------------------------------ endpoints
class Server:
    """A peer's HTTP server as a child process of this one: started, waited for until `ready_path` answers 200,
    stopped by its pid (SIGINT), then its process group (SIGTERM, SIGKILL) if it lingers."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str, timeout_s: float,
                 env: dict | None = None):
        self.name, self.cmd, self.ready_path, self.timeout_s = name, cmd, ready_path, timeout_s
        self.base = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"peers-{name}-", suffix=".log", delete=False)
        self.env = {**os.environ, **(env or {})}

    def __enter__(self) -> "Server":
        import requests

        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                     start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before it was ready; its log: "
                                   f"{self.log.name}\n{self.tail()}")
            try:
                if requests.get(self.base + self.ready_path, timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.perf_counter() - t0 > self.timeout_s:
                self.__exit__()
                raise RuntimeError(f"{self.name} not ready after {self.timeout_s:.0f} s; its log: {self.log.name}")
            time.sleep(1)
        self.startup_s = time.perf_counter() - t0
        return self

    def tail(self, n: int = 20) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def model_id(self) -> str:
        import requests

        return requests.get(self.base + "/v1/models", timeout=30).json()["data"][0]["id"]

    def __exit__(self, *exc) -> None:
        # SIGINT to the server alone (its own clean shutdown stops what it started), then its whole process group
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            if sig == signal.SIGINT:
                self.proc.send_signal(sig)
            else:
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue


def drive(base: str, model: str, prompts: list[list[int]], new_tokens: int, clients: int,
          extra: dict | None = None) -> dict:
    """The prompts through `base`/v1/completions (token ids, greedy) from `clients` threads, each sending its next
    prompt when its last one returned; 1: one after another. → {"tok_s", "tokens", "seconds", "outputs"}."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import requests

    local = threading.local()

    def one(ids: list[int]) -> dict:
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        t0 = time.perf_counter()
        r = session.post(f"{base}/v1/completions", timeout=1800, json={
            "model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, **(extra or {})})
        if not r.ok:
            raise RuntimeError(f"{base}/v1/completions answered {r.status_code}: {r.text[:500]}")
        body = r.json()
        usage = body["usage"]
        return {"text": body["choices"][0]["text"], "tokens": usage["completion_tokens"],
                "prompt_tokens": usage["prompt_tokens"], "sent_prompt_tokens": len(ids),
                "seconds": time.perf_counter() - t0}

    one(prompts[0][:])  # warm-up, unmeasured
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        outputs = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in outputs)
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall, "outputs": outputs}


def endpoint_row(key: str, label: str, server: Server, prompts, args, extra: dict | None = None) -> dict:
    model = server.model_id()
    row = {"key": key, "label": label, "where": "endpoint", "startup_s": server.startup_s, "command": server.cmd,
           "clients": {}, "notes": []}
    for c in (1, args.clients):
        row["clients"][str(c)] = drive(server.base, model, prompts, args.max_new_tokens, c, extra)
        print(f"[peers] {label} (endpoint), {c} client(s): {row['clients'][str(c)]['tok_s']:.1f} tok/s", flush=True)
    seen = {o["prompt_tokens"] - o["sent_prompt_tokens"] for m in row["clients"].values() for o in m["outputs"]}
    if seen != {0}:
        row["notes"].append(f"the server counted prompt tokens off by {sorted(seen)} from the ids sent")
    return row


def free_port() -> int:
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from serving import _free_port

    return _free_port()


# ------------------------------------------------------------------------------------------ parts
def part_vllm(args, prompts, stop_ids, report) -> None:
    from jetflow.vllm.regenerate import model_source

    spec = {"prompts": prompts, "stop_ids": sorted(stop_ids), "max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory(prefix="peers-vllm-") as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(spec))
        for key, label, head in ((VLLM_AR, "vLLM AR", None), ("vllm_dflash", "vLLM DFlash chain", args.vllm_head)):
            if key == "vllm_dflash" and not head:
                report["skipped"][f"{key}@in process"] = "no --vllm-head (a `jetflow export --to vllm` folder)"
                continue
            cmd = [args.vllm_python, str(ROOT / "benchmarks" / "peers_vllm.py"), "--model", model_source(TARGET),
                   "--prompts", f"{tmp}/prompts.json", "--clients", str(args.clients), "--out", f"{tmp}/{key}.json"]
            cmd += ["--spec-head", str(head)] if head else []
            print(f"[peers] {label} (in process, vLLM venv) ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(args), cwd=ROOT)
            if proc.returncode:
                raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
            got = json.loads((Path(tmp) / f"{key}.json").read_text())
            row = {"key": key, "label": label, "where": "in process", "startup_s": got["startup_s"],
                   "vllm_version": got["vllm_version"], "engine_kwargs": got["engine_kwargs"], "clients": {},
                   "notes": [f"{args.clients} clients: one generate() of every prompt, max_num_seqs {args.clients}"]}
            for c, m in got["clients"].items():
                tokens = sum(map(len, m["token_ids"]))
                row["clients"][c] = {"tok_s": tokens / m["seconds"], "tokens": tokens, "seconds": m["seconds"],
                                     "outputs": [{"ids": ids} for ids in m["token_ids"]]}
                if m["drafts"]:
                    row["clients"][c]["tau"] = 1 + m["accepted"] / m["drafts"]
                print(f"[peers] {label}, {c} client(s): {row['clients'][c]['tok_s']:.1f} tok/s", flush=True)
            report["rows"][f"{key}@in process"] = row


def vllm_env(args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform"), "VLLM_CPU_KVCACHE_SPACE":
           os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    if args.vllm_omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    return env


def part_vllm_serve(args, prompts, report) -> None:
    from jetflow.vllm.baseline import exported_depth
    from jetflow.vllm.generate import dflash_config
    from jetflow.vllm.regenerate import model_source

    for key, label, head in ((VLLM_AR, "vLLM AR", None), ("vllm_dflash", "vLLM DFlash chain", args.vllm_head)):
        if key == "vllm_dflash" and not head:
            report["skipped"][f"{key}@endpoint"] = "no --vllm-head (a `jetflow export --to vllm` folder)"
            continue
        port = free_port()
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_source(TARGET),
               "--served-model-name", TARGET, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(args.clients), "--no-enable-prefix-caching", "--seed", "0"]
        if head:
            cmd += ["--speculative-config", json.dumps(dflash_config(head, exported_depth(head)))]
        print(f"[peers] {label} (vLLM's OpenAI server) starting ...", flush=True)
        with Server(f"vllm-{key}", cmd, port, "/v1/models", args.startup_timeout, vllm_env(args)) as server:
            report["rows"][f"{key}@endpoint"] = endpoint_row(key, label, server, prompts, args)


def part_llamacpp(args, prompts, report) -> None:
    llama = Path(args.llama_dir).expanduser()
    server_bin, bench_bin = llama / "bin" / "llama-server", llama / "bin" / "llama-bench"
    gguf = Path(args.gguf).expanduser() if args.gguf else llama / "smollm2-135m-f32.gguf"
    missing = [str(p) for p in (server_bin, gguf) if not p.exists()]
    if missing:
        report["skipped"][f"{LLAMA_AR}@endpoint"] = f"missing {', '.join(missing)}: run `make llama-cpp`"
        print(f"[peers] llama.cpp skipped: {report['skipped'][f'{LLAMA_AR}@endpoint']}", flush=True)
        return
    port = free_port()
    cmd = [str(server_bin), "-m", str(gguf), "-t", str(args.threads), "-np", str(args.clients), "-c", "8192",
           "--jinja", "--host", "127.0.0.1", "--port", str(port)]
    print("[peers] llama.cpp AR (llama-server) starting ...", flush=True)
    with Server("llama-server", cmd, port, "/health", args.startup_timeout) as server:
        row = endpoint_row(LLAMA_AR, "llama.cpp AR", server, prompts, args, extra={"cache_prompt": False})
    if bench_bin.exists():  # its own decode speed: 64 tokens after an empty prompt, at 1 and THREADS threads
        threads = ",".join(map(str, sorted({1, args.threads})))
        proc = subprocess.run([str(bench_bin), "-m", str(gguf), "-t", threads, "-p", "0", "-n", "64", "-r", "3",
                               "-o", "json"], capture_output=True, text=True)
        if proc.returncode == 0:
            row["llama_bench"] = {str(r["n_threads"]): r["avg_ts"] for r in json.loads(proc.stdout)}
            row["notes"].append("llama-bench tg64: " + ", ".join(f"{t} thread(s) {v:.1f} tok/s"
                                                                 for t, v in row["llama_bench"].items()))
    report["rows"][f"{LLAMA_AR}@endpoint"] = row


def serving_choice(args, target):
    """The champion's head and tree as a replica would choose them (`--head`/`--algorithm`/... override) →
    (HeadChoice, the ServeConfig fields given)."""
    from jetflow.serving.config import ServeConfig
    from jetflow.serving.selection import choose_head

    given = {k: getattr(args, k) for k in ("head", "algorithm", "budget", "width") if getattr(args, k) is not None}
    return choose_head(ServeConfig(**given), target), given


def part_jetflow(args, target, prompts, choice, report) -> None:
    import torch

    from jetflow.decode import DecodeConfig
    from jetflow.engine import Engine, EngineConfig, decoder_for
    from jetflow.tree import TreeSpec

    torch.set_num_threads(args.threads)
    settings = [("jetflow_plain", "JetFlow plain", None, TreeSpec(budget=1))]
    if choice.speculative:
        settings.append(("jetflow_champion", f"JetFlow {choice.tree.key}", choice.head, choice.tree))
    longest = max(map(len, prompts))
    for key, label, head, tree in settings:
        cfg = DecodeConfig(tree=tree, max_new_tokens=args.max_new_tokens)
        row = {"key": key, "label": label, "where": "in process", "head": choice.label if head is not None else None,
               "tree": tree.to_dict(), "clients": {}, "notes": []}
        dec = decoder_for(target, head, args.graphs)
        row["compile_s"] = dec.warm(longest, cfg)
        row["graphs"] = getattr(dec, "graphs", "off")
        dec.generate(prompts[0], DecodeConfig(tree=tree, max_new_tokens=4))  # warm-up, unmeasured
        outputs, t0 = [], time.perf_counter()
        for ids in prompts:
            t = time.perf_counter()
            g = dec.generate(list(ids), cfg)
            outputs.append({"ids": g.token_ids, "seconds": time.perf_counter() - t,
                            "committed": g.stats.committed_per_round})
        row["clients"]["1"] = _in_process(outputs, time.perf_counter() - t0)
        print(f"[peers] {label}, 1 client: {row['clients']['1']['tok_s']:.1f} tok/s", flush=True)
        del dec
        depth = head.config.block_size if head is not None else 0  # a round may draft past max_new_tokens
        engine = Engine(target, head, EngineConfig(max_slots=args.clients, policy="fixed", graphs=args.graphs,
                                                   max_model_len=longest + args.max_new_tokens + depth + 1))
        engine.warm_lm_head()
        row["compile_s"] += engine.warm_decoding(cfg)
        row["graphs"] += f", {args.clients} slots: {engine.graphs} ({engine.graphs_reason})"
        engine.generate(prompts[: args.clients], DecodeConfig(tree=tree, max_new_tokens=4))  # warm-up
        t0 = time.perf_counter()
        gens = engine.generate(prompts, cfg)
        wall = time.perf_counter() - t0
        row["clients"][str(args.clients)] = _in_process(
            [{"ids": g.token_ids, "committed": g.stats.committed_per_round} for g in gens], wall)
        print(f"[peers] {label}, {args.clients} clients: {row['clients'][str(args.clients)]['tok_s']:.1f} tok/s",
              flush=True)
        del engine
        report["rows"][f"{key}@in process"] = row


def _in_process(outputs: list[dict], seconds: float) -> dict:
    from jetflow.metrics import tau

    tokens = sum(len(o["ids"]) for o in outputs)
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "tau": tau([c for o in outputs for c in o.pop("committed")]), "outputs": outputs}


def part_serve(args, prompts, choice, given, report) -> None:
    settings = [("jetflow_plain", "JetFlow plain", ["--head", "none"])]
    if choice.speculative:
        flags = [f for k, v in given.items() for f in (f"--{k}", str(v))]
        settings.append(("jetflow_champion", f"JetFlow {choice.tree.key}", flags))
    for key, label, flags in settings:
        port = free_port()
        cmd = [sys.executable, str(ROOT / "serve" / "app.py"), "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", str(free_port()), *flags, *(["--graphs", args.graphs] if args.graphs_given else []),
               *args.serve_args.split()]
        print(f"[peers] {label} (serve/app.py) starting ...", flush=True)
        with Server(f"serve-{key}", cmd, port, "/v1/models", args.startup_timeout) as server:
            row = endpoint_row(key, label, server, prompts, args)
            row["healthz"] = _healthz(server.base)
        report["rows"][f"{key}@endpoint"] = row


def _healthz(base: str) -> dict:
    import requests

    try:
        return requests.get(base + "/healthz", timeout=30).json()
    except (requests.RequestException, ValueError):
        return {}


# ------------------------------------------------------------------------------------------ main
def held_out_prompts(tokenizer, sets: list[str], n: int) -> tuple[list[list[int]], list[str]]:
    """`n` held-out prompts split evenly over `sets` (the first sets take the remainder), each set's spread over its
    eval split as an evaluation picks them, chat template applied → (token ids, prompt ids)."""
    from jetflow.data import spread_prompts
    from jetflow.decode import encode_prompt

    ids, names = [], []
    for i, name in enumerate(sets):
        for item in spread_prompts(name, n // len(sets) + (i < n % len(sets))):
            ids.append(encode_prompt(tokenizer, item.chat))
            names.append(item.id)
    return ids, names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts, split evenly over --sets")
    p.add_argument("--sets", default="humaneval,gsm", help="eval prompt sets (code, math; or mtbench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients of the second measurement")
    p.add_argument("--threads", type=int, default=2, help="threads of llama.cpp and of JetFlow in process")
    p.add_argument("--head", default=None, help="JetFlow's head (default: the registry's champion)")
    p.add_argument("--algorithm", default=None, help="tree algorithm (default: the champion's stored setting)")
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--graphs", default=None, help="off | compile | auto: JetFlow in process (default auto), and "
                                                  "passed to Serve when given (else Serve's default)")
    p.add_argument("--serve-args", default="", help="more serve/app.py options for the Serve rows, one string")
    p.add_argument("--vllm-head", default=None, help="a head exported by `jetflow export --to vllm` (DFlash rows)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="the vLLM venv's python (`make setup-vllm`)")
    p.add_argument("--vllm-omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default: vLLM's own)")
    p.add_argument("--llama-dir", default=None, help="where `make llama-cpp` put llama.cpp "
                                                     "(default $JETFLOW_HOME/peers/llama.cpp)")
    p.add_argument("--gguf", default=None, help="the fp32 GGUF (default: the one `make llama-cpp` wrote)")
    p.add_argument("--startup-timeout", type=float, default=1800, help="seconds a server may take to start")
    p.add_argument("--out", default=None, help="output folder (default $JETFLOW_HOME/bench/peers)")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {unknown}: use {', '.join(PARTS)}")
    if args.prompts < 1 or args.max_new_tokens < 1 or args.clients < 2 or args.threads < 1:
        p.error("--prompts, --max-new-tokens and --threads must be >= 1, --clients >= 2")
    args.graphs_given, args.graphs = args.graphs is not None, args.graphs or "auto"

    from jetflow.decode.prompt import stop_token_ids
    from jetflow.paths import jetflow_home
    from jetflow.target import TargetModel

    out = Path(args.out).expanduser() if args.out else jetflow_home() / "bench" / "peers"
    out.mkdir(parents=True, exist_ok=True)
    args.llama_dir = args.llama_dir or str(jetflow_home() / "peers" / "llama.cpp")
    report: dict = {"host": host_info(), "args": vars(args), "rows": {}, "skipped": {}, "part_seconds": {}}
    if report["host"]["busy_start"]:
        print("[peers] warning: this machine is not quiet; the timings will say so little:\n  "
              + "\n  ".join(report["host"]["busy_start"]), flush=True)
    target = TargetModel.load(TARGET)
    stop_ids = stop_token_ids(target)
    sets = [s for s in args.sets.split(",") if s]
    prompts, names = held_out_prompts(target.tokenizer, sets, args.prompts)
    report["prompts"] = {"count": len(prompts), "sets": sets, "ids": names, "tokens": [len(x) for x in prompts]}
    report["floor"] = measure_floor(sorted({1, 2, args.threads}))
    choice = given = None
    if {"jetflow", "serve"} & set(parts):
        choice, given = serving_choice(args, target)
        report["champion"] = {"head": choice.label, "tree": choice.tree.to_dict() if choice.tree else None,
                              "note": choice.note}
        if not choice.speculative:
            report["skipped"]["jetflow_champion"] = f"no speculative serving setting ({choice.note}); pass --head"

    def write() -> None:
        report["host"]["loadavg_end"] = os.getloadavg()
        add_ratios(report)
        compare_outputs(report, lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True), stop_ids)
        (out / "peers.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "peers.md").write_text(markdown(report))

    vllm_ok = Path(args.vllm_python).exists()
    for part in parts:
        t0 = time.perf_counter()
        try:
            if part.startswith("vllm") and not vllm_ok:
                report["skipped"][part] = f"no vLLM venv at {args.vllm_python}: run `make setup-vllm`"
                print(f"[peers] {part} skipped: {report['skipped'][part]}", flush=True)
            elif part == "vllm":
                part_vllm(args, prompts, stop_ids, report)
            elif part == "vllm-serve":
                part_vllm_serve(args, prompts, report)
            elif part == "llamacpp":
                part_llamacpp(args, prompts, report)
            elif part == "jetflow":
                part_jetflow(args, target, prompts, choice, report)
            elif part == "serve":
                part_serve(args, prompts, choice, given, report)
        except Exception as exc:  # noqa: BLE001  (one part's failure is reported; the other parts still run)
            report["skipped"][part] = f"failed: {exc.__class__.__name__}: {str(exc)[-1500:]}"
            traceback.print_exc()
        report["part_seconds"][part] = time.perf_counter() - t0
        write()
    report["host"]["busy_end"] = busy_processes()
    report["floor"]["threads_end"] = measure_floor(sorted({1, 2, args.threads}))["threads"]  # neighbours move it
    write()
    print(markdown(report))
    print(f"[peers] wrote {out / 'peers.json'} and {out / 'peers.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
