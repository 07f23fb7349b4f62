"""The `olmo-model` command: describe a model spec, list the presets.

    uv run --frozen olmo-model describe olmo3-7b                 # rich tables, seq len 8192
    uv run --frozen olmo-model describe my_spec.yaml --seq-len 65536 --json
    uv run --frozen olmo-model presets

`describe` prints the resolved spec, parameter counts (total, non-embedding, active; the total
and active also as the reports write them, 12.91B, 1.200T),
training FLOPs per token at the sequence length (sliding-window exact), and the memory of
weights, gradients and AdamW state. A bad preset or spec file is one line on stderr and
exit status 2. `presets` lists every preset's sizes, its experts (top-k, shared), how many
dense layers lead its MoE layers, and its active / total parameters.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from .maths import describe, param_counts
from .presets import PRESETS, SpecError, get_preset, load_spec
from .spec import ModelSpec

DEFAULT_SEQ_LEN = 8192  # Olmo 3 stage 1 sequence length


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olmo-model", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("describe", help="parameter counts, FLOPs per token and memory of a spec")
    d.add_argument("spec", metavar="PRESET_OR_SPEC_FILE", help="a preset name or a YAML/JSON spec file")
    d.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="sequence length for FLOPs (default 8192)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    sub.add_parser("presets", help="list the named presets")
    return parser


def _bytes(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:,.2f} GiB"
    return f"{n / 2**20:,.2f} MiB"


def _print_description(info: dict, console: Console) -> None:
    spec_table = Table(title=f"spec {info['spec'].get('name') or ''}".strip(), show_header=False)
    for key, value in info["spec"].items():
        spec_table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
    console.print(spec_table)

    numbers = Table(title=f"maths at seq_len {info['seq_len']}", show_header=False)
    numbers.add_row("params total", f"{info['params_total']:,} ({_short(info['params_total'])})")
    numbers.add_row("params non-embedding", f"{info['params_non_embedding']:,}")
    numbers.add_row("params active per token", f"{info['params_active']:,} ({_short(info['params_active'])})")
    numbers.add_row("params embedding + head", f"{info['params_embedding']:,}")
    numbers.add_row("training FLOPs per token", f"{info['flops_per_token']:.4e}")
    numbers.add_row("  of which attention", f"{info['attention_flops_per_token']:.4e}")
    numbers.add_row("layers sliding / global", f"{info['layers_sliding']} / {info['layers_global']}")
    console.print(numbers)

    memory = Table(title="training state memory (AdamW moments fp32)")
    memory.add_column("params")
    for column in ("weights", "gradients", "adamw_state", "total"):
        memory.add_column(column, justify="right")
    for label, key in (("fp32", "memory_fp32"), ("bf16", "memory_bf16_params_fp32_adam")):
        row = info[key]
        memory.add_row(label, *(_bytes(row[c]) for c in ("weights", "gradients", "adamw_state", "total")))
    console.print(memory)


def _short(n: float) -> str:
    """A parameter count as the reports write it: 1.59B, 12.91B, 1.200T."""
    return f"{n / 1e12:.3f}T" if n >= 1e12 else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _moe_columns(spec: ModelSpec) -> tuple[str, str]:
    """(routed experts x top-k + shared experts, dense layers before the first MoE layer) of a
    spec, '64x4+1' and '1'; '-' for a dense spec."""
    moe = spec.moe
    if moe is None:
        return "-", "-"
    first_moe = next(i for i in range(spec.n_layers) if spec.is_moe_layer(i))
    return f"{moe.n_experts}x{moe.top_k}+{moe.n_shared_experts}", str(first_moe)


def _presets_table() -> Table:
    table = Table(title="presets (heads: query/kv; experts: routed x top-k + shared)")
    table.add_column("name", no_wrap=True)
    headers = ("d_model", "layers", "heads", "head dim", "MLP hidden", "experts", "dense leading", "active/total")
    for column in headers:
        table.add_column(column, justify="right", no_wrap=True)
    for name in PRESETS:
        spec = get_preset(name)
        counts = param_counts(spec)
        sizes = (spec.d_model, spec.n_layers, f"{spec.n_heads}/{spec.kv_heads}", spec.head_dim, spec.mlp_hidden)
        table.add_row(
            name, *(str(v) for v in sizes), *_moe_columns(spec), f"{_short(counts.active)}/{_short(counts.total)}"
        )
    return table


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if args.command == "presets":
        table = _presets_table()
        # As wide as the table needs (a pipe's 80 columns would cut the names and counts).
        wanted = Console(width=1000).measure(table).maximum
        Console(width=max(console.width, wanted)).print(table)
        return 0

    if args.seq_len <= 0:
        print(f"olmo-model describe: --seq-len {args.seq_len} must be a positive number of tokens", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
    except (SpecError, OSError) as err:
        print(f"olmo-model describe: {err}", file=sys.stderr)
        return 2
    info = describe(spec, args.seq_len)
    if args.json:
        print(json.dumps(info))
    else:
        _print_description(info, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
