"""`kkdeploy triton-repo --artifacts DIR --out REPO`: a Triton model repository for what the build shipped."""

from __future__ import annotations

from pathlib import Path


def register(sub):
    p = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository for built artifacts")
    p.add_argument("--artifacts", required=True, help="artifact directory written by `kkdeploy build`")
    p.add_argument("--out", required=True, help="repository directory to write (replaced only with --force)")
    p.add_argument("--model-name", default="kkdeploy",
                   help="name clients call (default kkdeploy); the engine model is <name>_engine")
    add_topology_args(p)
    p.add_argument("--max-queue-delay-us", type=int, default=0,
                   help="how long the dynamic batcher may hold a request to fill a batch (default 0)")
    p.add_argument("--kubernetes", action="store_true",
                   help="also write kubernetes/ manifests (Deployment, Service, HorizontalPodAutoscaler on Triton's "
                        "queue time, the Prometheus adapter rule), checked against the Kubernetes schemas when "
                        "kubernetes-validate is installed")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=run)


def add_topology_args(p) -> None:
    """--engine, --topology, --instances: shared with `kkdeploy serve`."""
    from ..serving.triton_repo import ENGINE_CHOICES

    p.add_argument("--engine", choices=list(ENGINE_CHOICES), default="auto",
                   help="auto (default): one hop; the engine inside the batching Python model through kkdeploy.load, "
                        "or, where `kkdeploy serve` serves a CUDA artifact, the in-process backend if it can be "
                        "built here; "
                        "inprocess: one hop, the engine inside tritonserver's own process through kkdeploy's C++ "
                        "backend (compiled here for this Python; no stub, no shared-memory hop); native: an "
                        "onnxruntime/tensorrt engine model behind a Python front (two hops, batch B only); python: "
                        "kkdeploy.load")
    p.add_argument("--topology", choices=["auto", "one-hop", "two-hop"], default="auto",
                   help="auto (default): one-hop unless --engine native; two-hop: the front + engine layout of "
                        "before the one-hop layout (to compare against it)")
    p.add_argument("--instances", type=int, default=1,
                   help="model instances (instance_group count; each loads the engine; default 1). On a GPU, 4 "
                        "served 2.8x the throughput of 1 (H200, shape 3; docs/serving.md)")
    from ..serving.triton_repo import OUTPUT_DEVICES

    p.add_argument("--output-device", choices=OUTPUT_DEVICES, default="cpu",
                   help="one hop on a CUDA artifact: cpu (default) copies each answer to host memory in the model; "
                        "gpu hands Triton GPU tensors, for clients that read answers through CUDA shared memory "
                        "(docs/serving.md, 'Outputs in host memory': an extra round trip to the stub, and a stub "
                        "killed during it can return an unfilled answer as a success)")


def run(args) -> int:
    from ..serving.triton_repo import print_summary, write_repository

    info = write_repository(args.artifacts, args.out, model_name=args.model_name, engine=args.engine,
                            max_queue_delay_us=args.max_queue_delay_us, force=args.force, topology=args.topology,
                            instances=args.instances, kubernetes=args.kubernetes, output_device=args.output_device)
    print_summary(info)
    if args.kubernetes:
        from ..console import console

        console.print(f"  kubernetes/: {', '.join(sorted(p.name for p in (Path(info.path) / 'kubernetes').iterdir()))}")
    return 0
