"""The order XLA gives a ring's kernels and transfers, read without the GPUs it would run on.

On a machine with one GPU, JAX can compile for a described topology of several (compile-only
devices of the same kind): this script compiles :func:`ejkfn.ring_attention` for ``--devices`` of
them and prints each program's schedule, the entry computation's instructions in the order they
run, with the trivial ones (parameters, constants, tuples) left out. Whether a step's kernel runs
between a transfer's ``collective-permute-start`` and its ``-done`` shows there, before a run on
several GPUs times it (benchmarks/NOTES.md, sixty-seventh round).

Usage: ``python benchmarks/ring_schedule.py [--devices 2] [--seqs 32768] [--out DIR]``. On a CPU,
``--cpu-smoke`` compiles for two host devices at a small size (a check of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

if "--cpu-smoke" in sys.argv:  # two host devices; must be set before jax starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax
import jax.numpy as jnp
import numpy as np
from attention import device_info, fwd_bwd
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ejkfn

AXIS = "sp"
# Instructions that say nothing about the order of work.
_TRIVIAL = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "partition-id"}
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?(%[\w.\-]+) = .*?\s([a-z][a-z\-]*)\(")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="GPUs of this one's kind to compile for")
    p.add_argument("--seqs", default="32768", help="whole-sequence lengths")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", default="false,true", help="which masks (causal: zigzag layout)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--cpu-smoke", action="store_true")
    return p.parse_args(argv)


def schedule(hlo_text: str) -> list[tuple[str, str]]:
    """``(name, opcode)`` of the entry computation's instructions in order, trivial ones left out."""
    entry = hlo_text[hlo_text.index("\nENTRY") + 1 :]
    body = entry[: entry.index("\n}")].splitlines()[1:]
    found = (_INSTRUCTION.match(line) for line in body)
    return [(m[1], m[2]) for m in found if m and m[2] not in _TRIVIAL]


def devices_for(args: argparse.Namespace) -> list[Any]:
    if args.cpu_smoke:
        return jax.devices()[: args.devices]
    kind = f"1x1x{args.devices}"  # slices x hosts x devices a host
    return list(topologies.get_topology_desc(platform="cuda", topology=kind).devices)


def main() -> int:
    args = parse_args()
    devices = devices_for(args)
    mesh = Mesh(np.array(devices), (AXIS,))
    spec = PartitionSpec(None, AXIS)
    programs: list[dict[str, Any]] = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        x = jax.ShapeDtypeStruct(
            (1, seq, args.heads, args.dim), jnp.bfloat16, sharding=NamedSharding(mesh, spec)
        )
        for causal in [c.strip() == "true" for c in args.causal.split(",")]:
            layout = "zigzag" if causal else "contiguous"

            def ring(q: jax.Array, k: jax.Array, v: jax.Array, causal=causal, layout=layout):
                body = functools.partial(
                    ejkfn.ring_attention, axis_name=AXIS, causal=causal, layout=layout
                )
                mapped = jax.shard_map(
                    body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False
                )
                return mapped(q, k, v)

            training = fwd_bwd(ring)
            for part, fn, operands in (("fwd", ring, (x,) * 3), ("fwd_bwd", training, (x,) * 4)):
                order = schedule(jax.jit(fn).lower(*operands).compile().as_text())
                programs.append({"seq": seq, "causal": causal, "part": part, "schedule": order})
                print(f"--- {part}, {seq} keys, {'causal (zigzag)' if causal else 'no mask'}")
                for name, opcode in order:
                    print(f"    {opcode:28} {name}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = str(device_info().get("device_kind", "device")).replace(" ", "_")
    path = out / f"ring_schedule_{args.devices}x{kind}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    path.write_text(json.dumps({"args": settings, "programs": programs}, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
