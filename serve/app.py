"""Run the JetFlow OpenAI-compatible endpoint in the foreground; Ctrl-C stops it cleanly.

    python serve/app.py                                  # 127.0.0.1:8000: the champion head, else plain decoding
    python serve/app.py --head ~/.jetflow/heads/demo --budget 8 --algorithm top2gap:margin=1.5
    python serve/app.py --address auto                   # join the running Ray cluster: replicas on its worker nodes
    python serve/app.py --help                           # every option, with defaults
    serve run serve.app:app                              # the same application (defaults) via Ray's CLI
    serve run jetflow.serving.app:build_app head=random  # builder args as key=value
    serve deploy serve/config.yaml                       # onto a running cluster (`ray start --head` first)

Then: `curl 127.0.0.1:8000/v1/models`, or the `openai` client with base_url http://127.0.0.1:8000/v1.
With --api-key (better: $JETFLOW_API_KEY, which `ps` does not show) clients send it as their api_key
(`Authorization: Bearer ...`); binding an address other machines reach without one prints a warning.
Prometheus metrics (ray_jetflow_*, ray_serve_*) are on 127.0.0.1:<--metrics-port>/metrics with the local Ray
this script starts; on a cluster (--address) each node exports its own (Ray's metrics export port).
"""

from __future__ import annotations

import argparse
import sys
import time

from pydantic import ValidationError

from jetflow.config_cli import parse_args
from jetflow.serving.config import ServeConfig, add_arguments, from_arguments


def __getattr__(name: str):
    """`app`, what `serve run serve.app:app` reads: the bound application (defaults), nothing loaded until it is
    deployed. Built on first use, so that `python serve/app.py --help` imports no Ray."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from jetflow.serving.app import build_app

    globals()["app"] = application = build_app(ServeConfig())
    return application


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (default 8080; a local "
                   "Ray only: a cluster's nodes export their own)")
    p.add_argument("--address", default="local", help="Ray to run on: local (a Ray of this process, default), auto "
                   "(the cluster running on this machine, e.g. a head started by `ray start --head`) or host:port; "
                   "on a multi-node cluster replicas go to the nodes with CPUs (GPUs with --replica-gpus) and read "
                   "the registry from MLFLOW_TRACKING_URI, handed to them as their nodes reach it")
    add_arguments(p)
    args = parse_args(p, argv)
    try:
        cfg = from_arguments(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        option = "-".join(str(x) for x in err["loc"]).replace("_", "-")
        message = err["msg"].removeprefix("Value error, ")
        print(f"serve: error: {f'--{option}: ' if option else ''}{message}", file=sys.stderr)
        return 2

    from jetflow.errors import JetFlowError
    from jetflow.serving.app import build_app
    from jetflow.serving.auth import exposure_warning, key_from_env

    warning = exposure_warning(args.host, key_from_env(cfg).api_key)
    if warning:
        print(f"serve: warning: {warning}", file=sys.stderr, flush=True)

    local = args.address == "local"
    if local:
        try:
            application = build_app(cfg)  # a missing head fails here, before Ray starts
        except JetFlowError as exc:
            print(f"serve: error: {exc}", file=sys.stderr)
            return 2

    import ray
    from ray import serve

    from jetflow.cluster import init_ray

    try:
        if local:
            ray.init(address="local", include_dashboard=False, _metrics_export_port=args.metrics_port)
        else:  # a cluster: the replicas' environment (tracking URI as their nodes reach it), then the checks
            init_ray(args.address, need_storage=False, log_to_driver=True)
            application = build_app(cfg)
    except JetFlowError as exc:
        print(f"serve: error: {exc}", file=sys.stderr)
        ray.shutdown()
        return 2
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name="jetflow", route_prefix="/")
        print(f"JetFlow serving on http://{args.host}:{args.port}/v1 (metrics :{args.metrics_port}/metrics); "
              "Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
    finally:
        if local:
            serve.shutdown()
        else:  # on a cluster: remove this application only; other applications keep serving
            serve.delete("jetflow")
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
