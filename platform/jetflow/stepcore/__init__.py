"""The step core: JetFlow's own forward of one decoding step over static-shape buffers, compiled per bucket.

The eager path (`jetflow.target.TargetModel.forward_rows`, `jetflow.head.DraftHead.forward_cached`, HF's
forward inside) stays the readable reference. This room is the fast path beside it, in a few files:

- `modes`    — the `graphs` setting (auto | compile | off) and what `auto` resolves to on this host;
- `buckets`  — the static shapes a step is padded to: (rows, nodes, key window), and the KV capacity steps;
- `target`   — `TargetCore`: embeddings → RoPE → the layer loop with the KV write inside → taps → final norm →
               the argmax of every node and the greedy acceptance of every row, on the device;
- `head`     — `HeadCore`: the draft head's cached forward and its top-W per depth;
- `runner`   — `StepRunner`: one entry per bucket, persistent input buffers filled in place, compiled with
               `torch.compile(fullgraph=True, dynamic=False)`, compile time counted.

The engine (`jetflow.engine`) runs it; `jetflow.engine.decoder_for` gives single-stream callers a one-slot engine
with the reference decoder's API; `jetflow.eval.graphs` is the host measurement `graphs=auto` reads.

This package's `__init__` imports nothing heavy: `jetflow.stepcore.modes` is read by option parsers.
"""
