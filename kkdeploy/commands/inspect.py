"""`kkdeploy inspect DIR`: the manifest, readably; exit 1 when any file differs from its recorded hash."""

from __future__ import annotations

from pathlib import Path

from ..pipeline.build import print_summary
from ..console import console, err_console
from ..pipeline.runtime import read_manifest, verify_files


def register(sub):
    p = sub.add_parser("inspect", help="print an artifact directory's manifest readably")
    p.add_argument("path", help="artifact directory")
    p.set_defaults(func=run)


def run(args) -> int:
    root = Path(args.path)
    m = read_manifest(root)
    env = m["environment"]
    c = m["config"]
    console.print(f"[bold]{root}[/]  shape {m.get('shape_id') or 'custom'}: B={c['batch_size']} S={c['seq_len']} "
                  f"D={c['d_model']} H={c['num_heads']} F={c['ffn_dim']} L={c['num_layers']} "
                  f"causal={c['causal']}  dtype {m['dtype']}")
    console.print(f"built {m['created']} in {m.get('build_seconds', '?')} s on {env['device']['name']} "
                  f"({env['device']['type']}, {env['device']['capability']})")
    from ..pipeline.build import stages_line, timing_line

    for line in (stages_line(m), timing_line(m)):
        if line:
            console.print(line, soft_wrap=True)
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v))
    v = m["validation"]
    console.print(f"validation: {v['contract']} (atol {v['atol']}, rtol {v['rtol']}), seeds {v['seed']}.."
                  f"{v['seed'] + v['trials'] - 1}, masks {', '.join(v['mask_modes'])} (padding {v['padding_ratio']})")
    console.print(f"weights: {m['weights']['source']} sha256 {m['weights']['sha256'][:16]}…; "
                  f"fallback OptimizedTransformer sdpa_layers={m['fallback']['sdpa_layers']}")
    problem = verify_files(root, m)
    console.print(f"files: {len(m['files'])} hashed; " + (f"[red]{problem}[/]" if problem else "all match"))
    print_summary(m, root)
    if problem:  # `kkdeploy inspect DIR && deploy` must stop here
        err_console.print(f"[bold red]error:[/] {root}: {problem}; rebuild the artifacts", soft_wrap=True)
        return 1
    return 0
