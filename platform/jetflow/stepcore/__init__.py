"""The step core: JetFlow's own forward of one decoding step, compiled — the fast path beside the eager reference.

The eager path (`jetflow.target.TargetModel.forward_rows`, `jetflow.head.DraftHead.forward_cached`, HF's forward
inside) stays the readable reference. This room is the fast path beside it, in a few files:

- `modes`     — the `graphs` setting (auto | compile | off) and what `auto` resolves to on this host;
- `target`    — `TargetStep`: embeddings → RoPE → the layer loop with the KV write inside → taps → final norm, over
                a flat token axis (rows × nodes); `LMHead`, the target's LM head as its own graph;
- `head`      — `DraftStep`: the draft head's block for every row → the top-k per depth;
- `attention` — `slot_attention`, the one op that sees the (rows, nodes) structure, opaque to the compiler;
- `inductor`  — how the graphs are compiled: frozen weights, inductor's C++ GEMM template, its register block;
- `runner`    — `StepRunner`: one graph per role with dynamic shapes, the host-side layout of a step (padding
                masked both ways), compile time counted;
- `buckets`   — the static KV's capacity and where a step writes into it.

The engine (`jetflow.engine`) runs it; `jetflow.engine.decoder_for` gives single-stream callers a one-slot engine
with the reference decoder's API; `jetflow.engine.calibrate` is the first-use measurement `graphs=auto` keeps.

This package's `__init__` imports nothing heavy: `jetflow.stepcore.modes` is read by option parsers.
"""
