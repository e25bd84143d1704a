"""The report of benchmarks/peers.py, apart from the runs (plain Python, tested without a model): outputs compared
token by token with a reference row, each row's tokens/s as a ratio to vLLM AR and to llama.cpp AR, the weight-read
floor, the markdown table.

A report: {"host", "args", "prompts", "floor", "rows": {"KEY@WHERE": row}, "skipped", ...}; a row: {"key", "label",
"where" ("in process" | "endpoint"), "clients": {"1": m, "N": m}, "notes"}; m: {"tok_s", "tokens", "seconds",
"outputs": [{"ids": [...]} or {"text": "..."} per prompt, in prompt order]}.
"""

from __future__ import annotations

# the two rows every ratio is taken against
VLLM_AR, LLAMA_AR = "vllm_ar", "llamacpp_ar"


def strip_stop(ids: list[int], stop_ids) -> list[int]:
    """Generated ids up to, not including, the first stop id: what every engine's text holds."""
    for k, t in enumerate(ids):
        if t in stop_ids:
            return list(ids[:k])
    return list(ids)


def first_difference(got: list[int], ref: list[int]) -> int | None:
    """The first position where two id lists differ (or where the shorter one ends); None when equal."""
    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if k is None and len(got) != len(ref):
        k = min(len(got), len(ref))
    return k


def first_text_difference(text: str, ref: list[int], decode) -> int | None:
    """For an endpoint that returns text only: the first reference token its text leaves (None: the text is the
    reference's, decoded). `decode(ids) -> str`. A prefix that ends inside a multi-byte character decodes to a
    replacement character: it is judged with the token that completes the character, and a mismatch there is
    placed at the character's first token."""
    good = 0  # reference tokens the text holds, up to a whole character
    for k in range(1, len(ref) + 1):
        prefix = decode(ref[:k])
        if prefix.endswith("\ufffd"):
            continue
        if not text.startswith(prefix):
            return good
        good = k
    return None if text == decode(ref) else good


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def baseline_row(rows: dict, key: str, where: str) -> tuple[dict | None, bool]:
    """The row a ratio is taken against: `key`'s measurement at the same place (in process / endpoint) if there is
    one, else the other → (row, same place)."""
    same = rows.get(f"{key}@{where}")
    if same:
        return same, True
    other = next((r for k, r in rows.items() if k.startswith(f"{key}@")), None)
    return other, False


def add_ratios(report: dict) -> None:
    """Each row's tok/s ratio to vLLM AR and to llama.cpp AR at every client count, in place."""
    rows = report["rows"]
    for row in rows.values():
        row["ratios"] = {}
        for base_key in (VLLM_AR, LLAMA_AR):
            base, same = baseline_row(rows, base_key, row["where"])
            for c, m in row["clients"].items():
                b = base["clients"].get(c) if base else None
                row["ratios"].setdefault(c, {})[base_key] = {
                    "ratio": ratio(m.get("tok_s"), b.get("tok_s") if b else None), "same_place": same}


def floor_figures(weight_bytes: int, bandwidth_gbs: dict) -> dict:
    """{threads: {"gbs", "step_ms", "tok_s"}}: a plain step reads every weight once, so it costs at least
    weight_bytes / bandwidth (one row's tokens/s at most the inverse)."""
    out = {}
    for threads, gbs in bandwidth_gbs.items():
        ms = weight_bytes / (gbs * 1e9) * 1e3
        out[str(threads)] = {"gbs": gbs, "step_ms": ms, "tok_s": 1e3 / ms}
    return out


def _fmt(x, spec: str = ".1f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def markdown(report: dict) -> str:
    """The report's table: tok/s at 1 and N clients per row, ratios to vLLM AR and llama.cpp AR, the floor."""
    h, a = report["host"], report["args"]
    n = str(a["clients"])
    lines = [f"### JetFlow vs vLLM and llama.cpp ({h['date']}, {h['cpu']}, {h['cores']} cores, git {h['commit']})", "",
             (f"{report['prompts']['count']} held-out prompts ({', '.join(report['prompts']['sets'])}), chat template, "
              f"greedy, at most {a['max_new_tokens']} new tokens, {a['threads']} threads where a row takes a thread "
              f"count; tokens/s end to end (prefill included). Load average at start "
              f"{_fmt(h['loadavg_start'][0], '.2f')}, at end {_fmt(h.get('loadavg_end', [None])[0], '.2f')}."), ""]
    for when in ("start", "end"):
        if h.get(f"busy_{when}"):
            lines += [f"Other processes at the {when} (over 5 % of a core): " + "; ".join(h[f"busy_{when}"]), ""]
    fl = report.get("floor")
    if fl:
        end = fl.get("threads_end", {})
        per = "; ".join(f"{t} thread{'s' if t != '1' else ''}: {f['gbs']:.1f} GB/s"
                        + (f" ({end[t]['gbs']:.1f} at the end)" if t in end else "")
                        + f" → ≥ {f['step_ms']:.1f} ms a plain step (≤ {f['tok_s']:.0f} tok/s one stream)"
                        for t, f in fl["threads"].items())
        lines += [f"Weight-read floor: {fl['weight_bytes'] / 1e6:.0f} MB of weights read per step; {per}.", ""]
    floor_ms = fl["threads"].get(str(a["threads"]), {}).get("step_ms") if fl else None
    lines += [f"| row | where | 1 client tok/s | × vLLM AR | × llama.cpp AR | ms/token ÷ floor | {n} clients tok/s "
              f"| × vLLM AR | × llama.cpp AR | identical to {report.get('reference') or '–'} |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"].values():
        cells = [row["label"], row["where"]]
        for c in ("1", n):
            m = row["clients"].get(c, {})
            cells.append(_fmt(m.get("tok_s")))
            for base in (VLLM_AR, LLAMA_AR):
                r = row.get("ratios", {}).get(c, {}).get(base, {})
                cells.append(_fmt(r.get("ratio"), ".2f") + ("" if r.get("same_place", True) or r.get("ratio") is None
                                                            else "†"))
            if c == "1":
                cells.append(_fmt(ratio(1e3 / m["tok_s"], floor_ms) if m.get("tok_s") and floor_ms else None, ".2f"))
        same = row.get("identical", {})
        cells.append(", ".join(f"{c}: {s['identical']}/{s['prompts']}" + (f" (first diff at {s['first_diffs']})"
                                                                           if s["identical"] < s["prompts"] else "")
                               for c, s in same.items()) or "–")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "† ratio to the other place's row (in process vs endpoint). First diff: token position per prompt "
                  "(None: identical)."]
    for key, note in report.get("skipped", {}).items():
        one_line = " / ".join(part.strip() for part in str(note).splitlines() if part.strip())
        lines.append(f"- skipped {key}: {one_line[-400:]}")
    for row in report["rows"].values():
        for note in row.get("notes", []):
            lines.append(f"- {row['label']} ({row['where']}): {note}")
    return "\n".join(lines) + "\n"


def compare_outputs(report: dict, decode, stop_ids) -> None:
    """Each row's outputs against the reference row's 1-client ids, in place: per client count, how many prompts
    are identical and the first differing position of each."""
    rows = report["rows"]
    ref_key = next((k for k in (f"{VLLM_AR}@in process", "jetflow_plain@in process") if k in rows), None)
    report["reference"] = rows[ref_key]["label"] + " (" + rows[ref_key]["where"] + ")" if ref_key else None
    if ref_key is None:
        return
    ref = [strip_stop(o["ids"], stop_ids) for o in rows[ref_key]["clients"]["1"]["outputs"]]
    for row in rows.values():
        row["identical"] = {}
        for c, m in row["clients"].items():
            diffs = []
            for out, expected in zip(m["outputs"], ref):
                if "ids" in out:
                    diffs.append(first_difference(strip_stop(out["ids"], stop_ids), expected))
                else:
                    diffs.append(first_text_difference(out["text"], expected, decode))
            row["identical"][c] = {"prompts": len(diffs), "identical": sum(d is None for d in diffs),
                                   "first_diffs": diffs}
