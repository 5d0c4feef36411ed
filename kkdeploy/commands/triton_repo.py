"""`kkdeploy triton-repo --artifacts DIR --out REPO`: a Triton model repository for what the build shipped."""

from __future__ import annotations


def register(sub):
    p = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository for built artifacts")
    p.add_argument("--artifacts", required=True, help="artifact directory written by `kkdeploy build`")
    p.add_argument("--out", required=True, help="repository directory to write (replaced only with --force)")
    p.add_argument("--model-name", default="kkdeploy",
                   help="name clients call (default kkdeploy); the engine model is <name>_engine")
    p.add_argument("--engine", choices=["auto", "native", "python"], default="auto",
                   help="auto (default): onnxruntime/tensorrt backend where an ORT/TensorRT engine shipped, else "
                        "the Python backend through kkdeploy.load; python: always kkdeploy.load")
    p.add_argument("--max-queue-delay-us", type=int, default=0,
                   help="how long the dynamic batcher may hold a request to fill a batch (default 0)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..serving.triton_repo import print_summary, write_repository

    info = write_repository(args.artifacts, args.out, model_name=args.model_name, engine=args.engine,
                            max_queue_delay_us=args.max_queue_delay_us, force=args.force)
    print_summary(info)
    return 0
