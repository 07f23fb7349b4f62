"""The compiled step's FLOPs and time as XLA's cost analysis gives them, with every loop's trip count
(``dry_run``).

XLA's cost analysis counts the body of a while loop (every ``lax.scan``: the layer scan, its
backward, the head-loss chunks, the accumulation micro-steps) once. ``scaled_cost`` takes the
optimized program's text, reads each loop's trip count from its condition, costs each loop body on
its own with XLA's cost analysis (``hlo_module_cost_analysis``, the CPU client's HloCostAnalysis,
the same FLOP count as the TPU executable's; the program-level totals agree) and adds
(trip count - 1) x body for every loop, nested loops included. The compiler's ``optimal_seconds``
is scaled by the same factor as its FLOPs (the loop bodies are taken to run at the program's mean
FLOP rate): an estimate of the step time from XLA's cost model, not a measurement. XLA:GPU states a
loop's trip count on the loop itself (``known_trip_count``), which is taken where present. Its cuDNN
attention calls are opaque to the cost analysis; ``cudnn_attention_flops`` counts them from their
shapes. XLA:GPU's compiled program has no ``optimal_seconds``, so a GPU report has no step estimate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jax

_WHILE = re.compile(r"\bwhile\((%[\w.\-]+)\), condition=%([\w.\-]+), body=%([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUDNN_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_DEF = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = ")


@dataclass(frozen=True)
class ScaledCost:
    flops: float  # per device, every loop body times its trip count
    flops_once: float  # XLA's own program total (each loop body once)
    trip_counts: dict[str, int]  # loop body computation -> trip count


def _computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its lines, from an HLO module's text."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.split("\n"):
        m = _COMPUTATION.match(line)
        if m and line.rstrip().endswith("{"):
            current = out.setdefault(m.group(1), [])
        if current is not None:
            current.append(line)
        if line == "}":
            current = None
    return out


def _defs(lines: list[str]) -> dict[str, str]:
    """Instruction name (with its %) -> the rest of its line after ``= ``, for one computation."""
    return {m.group(1): line[m.end() :] for line in lines if (m := _DEF.match(line))}


def _operands(instruction: str, op: str) -> list[str]:
    """The operand names of ``op(...)`` in an instruction's text."""
    inside = instruction[instruction.index(f" {op}(") + len(op) + 2 :]
    inside = re.sub(r"/\*.*?\*/", "", inside[: inside.index(")")])
    return [a.strip() for a in inside.split(",")]


def _constant(defs: dict[str, str], name: str) -> int | None:
    """The integer scalar constant ``name`` holds, through copies (XLA moves loop counters between
    memory spaces with copy / copy-start / copy-done), or None."""
    instruction = defs.get(name, "")
    for _ in range(len(defs)):
        m = re.match(r"[su](?:32|64)\[\]\S* (constant|copy|copy-start|copy-done|bitcast)\((\S+?)\)", instruction)
        if m is None:
            return None
        if m.group(1) == "constant":
            return int(m.group(2))
        instruction = defs.get(m.group(2), "")
    return None


def _tuple_index(instruction: str) -> int | None:
    m = re.search(r"get-tuple-element\(%[\w.\-]+\), index=(\d+)", instruction)
    return int(m.group(1)) if m else None


def _trip_count(caller: list[str], init: str, condition: list[str], body: list[str]) -> int:
    """A while loop's trip count from its text: the condition is ``counter < N``, the body adds a
    constant step to the counter, the caller starts it from a constant (JAX's scans and the SPMD
    partitioner's windowed-einsum loops are all of this form); any other loop is refused rather
    than guessed."""
    cond, step_defs, caller_defs = _defs(condition), _defs(body), _defs(caller)
    root = next(line for line in condition if line.lstrip().startswith("ROOT"))
    problem = f"cannot read the trip count of a while loop from its condition: {root.strip()[:200]}"
    m = re.search(r"compare\((%[\w.\-]+), (%[\w.\-]+)\), direction=LT", root)
    if not m:
        raise ValueError(problem)
    index, bound = _tuple_index(cond.get(m.group(1), "")), _constant(cond, m.group(2))
    body_root = next(line for line in body if line.lstrip().startswith("ROOT"))
    if index is None or bound is None or " tuple(" not in body_root:
        raise ValueError(problem)
    update = step_defs.get(_operands(body_root, "tuple")[index], "")
    if " add(" not in update:
        raise ValueError(problem)
    step = next((c for a in _operands(update, "add") if (c := _constant(step_defs, a)) is not None), None)
    start = (
        _constant(caller_defs, _operands(caller_defs[init], "tuple")[index])
        if " tuple(" in caller_defs.get(init, "")
        else None
    )
    if step is None or step <= 0 or start is None:
        raise ValueError(problem)
    return max(0, -(-(bound - start) // step))


def cudnn_attention_flops(line: str) -> float:
    """FLOPs of one cuDNN fused-attention call (XLA:GPU's ``__cudnn$fmha*`` custom calls), from its
    backend config: scores [B, N, Sq, Sk] (``intermediate_tensor_shape``), head width H (the
    output's last dimension), the keys each query sees (all Sk; causal: query i sees i + 1; a
    ``sliding_window_length`` W: at most W), and its matmul passes of 2 x H FLOPs per (query, key):
    2 forward (scores, values), 5 backward (scores recomputed, dV, dP, dQ, dK: FlashAttention's
    backward). The useful work, as olmo_model counts attention; the kernel's masked halves of
    diagonal tiles are not in it. 0 for a line that is no such call."""
    m = _CUDNN_FMHA.search(line)
    if m is None:
        return 0.0
    config = json.loads(line[line.index("backend_config=") + len("backend_config=") :])["cudnn_fmha_backend_config"]
    B, N, Sq, Sk = (int(x) for x in config["intermediate_tensor_shape"]["dimensions"])
    head = int(re.search(r"= \(?\w+\[([\d,]+)\]", line).group(1).split(",")[-1])  # type: ignore[union-attr]
    window = int(config.get("sliding_window_length", 0) or 0)
    if "CAUSAL" in config.get("mask_type", "NO_MASK"):
        # Query i sees min(i + 1, W) keys: a triangle of W rows, then W keys per row.
        w = window if 0 < window < Sq else Sq
        seen = w * (w + 1) // 2 + (Sq - w) * w
    else:
        seen = Sq * (min(Sk, window) if window else Sk)
    passes = 5 if m.group(1).endswith("Backward") else 2
    return float(passes * 2 * head * B * N * seen)


def _reach(name: str, callees: dict[str, set[str]]) -> set[str]:
    """``name`` and every computation it calls, directly or not."""
    reach, todo = {name}, [name]
    while todo:
        for c in callees[todo.pop()] - reach:
            reach.add(c)
            todo.append(c)
    return reach


def _flops_with_entry(name: str, header: str, comps: dict[str, list[str]], callees: dict[str, set[str]]) -> float:
    """XLA's FLOP count of computation ``name`` made the entry of a module of its own (each loop
    in it once), plus its cuDNN attention calls counted from their shapes."""
    import jaxlib._hlo as hlo
    from jax._src.lib import _jax

    reach = _reach(name, callees)
    lines = [header]
    for comp, body in comps.items():  # in the module's order: callees are defined before callers
        if comp in reach:
            first = body[0].removeprefix("ENTRY ")
            lines += ["ENTRY " + first if comp == name else first, *body[1:]]
    # Stack frame ids point into a table of the whole module's text that a sub-module lacks.
    module = hlo.hlo_module_from_text(re.sub(r" ?stack_frame_id=\d+", "", "\n".join(lines)))
    # XLA counts a custom call as no FLOPs: cuDNN's attention is counted from its shapes.
    opaque = sum(cudnn_attention_flops(line) for comp in reach for line in comps[comp])
    client = jax.devices("cpu")[0].client
    return float(_jax.hlo_module_cost_analysis(client, module).get("flops", 0.0)) + opaque


def _while_loop(line: str) -> tuple[str, str, str, int | None] | None:
    """(init, condition, body, trip count where XLA states it) of a while instruction's line, or None."""
    m = _WHILE.search(line)
    if m is None:
        return None
    known = _KNOWN_TRIPS.search(line)
    init, condition, body = m.groups()
    return init, condition, body, int(known.group(1)) if known else None


def scaled_cost(hlo_text: str) -> ScaledCost:
    """The compiled program's FLOPs per device with every while loop's body counted trip-count times
    (module docstring)."""
    header, _, rest = hlo_text.partition("\n")
    # The module's attributes (entry layout, schedule, aliasing) describe the real entry; a body
    # made the entry would contradict them, and the FLOP count needs none of them.
    header = header.split(",")[0]

    comps = _computations(rest)
    # The computations each one calls (fusions, reductions, loop bodies...): a sub-module holds only
    # what its entry reaches, so costing a loop body does not parse the whole program again.
    callees = {
        name: {c for c in re.findall(r"%([\w.\-]+)", "\n".join(lines[1:])) if c in comps and c != name}
        for name, lines in comps.items()
    }
    loops = {name: [w for line in lines if (w := _while_loop(line))] for name, lines in comps.items()}
    entry = next(name for name, lines in comps.items() if lines[0].startswith("ENTRY "))
    once: dict[str, float] = {}
    trips: dict[str, int] = {}

    def cost_once(name: str) -> float:
        if name not in once:
            once[name] = _flops_with_entry(name, header, comps, callees)
        return once[name]

    def total(name: str) -> float:
        # Each loop directly in this computation is in its cost once; count it trip-count times.
        t = cost_once(name)
        for init, condition, body, known in loops.get(name, []):
            trips[body] = known if known is not None else _trip_count(comps[name], init, comps[condition], comps[body])
            t += trips[body] * total(body) - cost_once(body)
        return t

    flops = total(entry)
    nested = {body for found in loops.values() for _, _, body, _ in found}
    if nested - set(trips):
        # A loop inside something other than the entry or a loop body (a conditional, a call).
        raise ValueError(f"while loops outside the entry's loop nest are not counted: {sorted(nested - set(trips))}")
    return ScaledCost(flops=flops, flops_once=cost_once(entry), trip_counts=trips)


def step_estimate(optimal_seconds: float | None, cost: ScaledCost) -> float | None:
    """The step time XLA's cost model implies: its ``optimal_seconds`` for the program with each loop
    once, scaled by the loops' trip counts (module docstring); None where the model gives no
    positive figure (XLA:GPU states none; XLA:TPU's is negative for some targets, e.g. tpu7x at
    512 devices, which is no time at all)."""
    if optimal_seconds is None or not optimal_seconds > 0 or not cost.flops_once > 0:
        return None
    return float(optimal_seconds) * cost.flops / cost.flops_once
