"""`kkdeploy shapes`: the official workload table."""

from ..config import LONG_CONTEXT_SHAPES, OFFICIAL_SHAPES
from ..console import console, table


def register(sub):
    p = sub.add_parser("shapes", help="print the official workload shapes")
    p.set_defaults(func=run)


def run(args) -> int:
    rows = []
    for sid, c in OFFICIAL_SHAPES.items():
        note = "long context: bounded-memory path" if sid in LONG_CONTEXT_SHAPES else ""
        rows.append([sid, c.batch_size, c.seq_len, c.d_model, c.num_heads, c.ffn_dim, c.num_layers,
                     "yes" if c.causal else "no", note])
    console.print(table("Official shapes", ["id", "B", "S", "D", "H", "F", "L", "causal", "note"], rows))
    return 0
