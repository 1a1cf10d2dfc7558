"""The ``ejkfn`` command line: tune kernels for given shapes, and inspect or edit the persistent cache."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


class UsageError(Exception):
    """A bad argument: reported in one line with a non-zero exit."""


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape must be comma-separated integers; got {text!r}"
        ) from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"--shape dimensions must be positive; got {text!r}")
    return dims


def _dtype(name: str) -> Any:
    import jax.numpy as jnp

    table = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if name not in table:
        raise UsageError(f"--dtype must be one of {sorted(table)}; got {name!r}")
    return table[name]


# --- workloads: (kernel, abstract args, kwargs) per invocation -----------------------------------


def _scale_calls(args: argparse.Namespace) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    import jax

    from .testing import Scale

    shapes = [args.shape] if args.shape else [(256, 128), (1024, 256)]
    calls = []
    for shape in shapes:
        if len(shape) != 2:
            raise UsageError(
                f"scale takes a 2-d --shape ROWS,COLS; got {','.join(map(str, shape))}"
            )
        calls.append((Scale(), (jax.ShapeDtypeStruct(shape, _dtype(args.dtype)),), {}))
    return calls


def _attention_calls(args: argparse.Namespace) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    import jax

    try:
        from .attention import FlashAttention
    except ImportError as exc:  # pragma: no cover - the package ships it
        raise UsageError(f"flash_attention is not available: {exc}") from exc
    shapes = [args.shape] if args.shape else [(1, 256, 4, 64)]
    calls = []
    for shape in shapes:
        if len(shape) != 4:
            raise UsageError(
                "flash_attention takes --shape BATCH,SEQ,HEADS,DIM; "
                f"got {','.join(map(str, shape))}"
            )
        batch, seq, heads, dim = shape
        kv_heads = args.kv_heads or heads
        if heads % kv_heads:
            raise UsageError(f"--kv-heads {kv_heads} must divide heads {heads}")
        dtype = _dtype(args.dtype)
        q = jax.ShapeDtypeStruct((batch, seq, heads, dim), dtype)
        kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, dim), dtype)
        calls.append((FlashAttention(platform=args.platform), (q, kv, kv), {"causal": args.causal}))
    return calls


KERNELS: dict[
    str, Callable[[argparse.Namespace], list[tuple[Any, tuple[Any, ...], dict[str, Any]]]]
] = {
    "scale": _scale_calls,
    "flash_attention": _attention_calls,
}


def _builtin(args: argparse.Namespace) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    calls = _scale_calls(args)
    try:
        calls += _attention_calls(args)
    except UsageError:
        pass
    return calls


def _cmd_tune(args: argparse.Namespace) -> int:
    import ejkfn

    if args.kernel is None:
        if args.shape:
            raise UsageError("--shape needs a kernel name: ejkfn tune KERNEL --shape ...")
        calls = _builtin(args)
    elif args.kernel in KERNELS:
        calls = KERNELS[args.kernel](args)
    else:
        raise UsageError(f"unknown kernel {args.kernel!r}; known: {', '.join(sorted(KERNELS))}")
    store = ejkfn.PersistentCache(args.cache_dir)
    try:
        tuner = ejkfn.Tuner(
            warmup=args.warmup,
            iters=args.iters,
            runoff=args.runoff,
            progress=None if args.quiet else True,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    failed = 0
    for kernel, call_args, call_kwargs in calls:
        inv = ejkfn.Invocation.of(kernel, *call_args, **call_kwargs)
        # The command exists to measure, so it does not stop at a cached answer.
        report = tuner.tune(inv, kernel.candidate_cfgs(inv), validate_backward=args.backward)
        print(f"\n{inv!r}")
        print(report.table())
        for note in report.notes:
            print(f"note: {note}")
        if report.best is None:
            print("no candidate worked")
            failed += 1
            continue
        print(f"chosen: {report.best!r}")
        seconds = min(r.seconds for r in report.results if r.ok)
        store = store.put(
            inv.key,
            report.best,
            meta={"invocation": inv.payload, "seconds": seconds, "backward": report.backward},
        )
    if not args.no_save:
        count = len(store.pending)
        store = store.save()
        print(f"\nsaved {count} config(s) to {store.path}")
    return 1 if failed else 0


def _cmd_cache(args: argparse.Namespace) -> int:
    import ejkfn

    store = ejkfn.PersistentCache(args.cache_dir)
    action = args.action
    if action == "path":
        print(store.path)
    elif action == "ls":
        keys = sorted(k for k in store.keys() if not args.kernel or k.startswith(f"{args.kernel}/"))
        for key in keys:
            record = store.record(key) or {}
            cfg = record.get("cfg", {})
            print(f"{key}  {json.dumps(cfg.get('fields', cfg), sort_keys=True)}")
        print(f"{len(keys)} entries in {store.path}", file=sys.stderr)
    elif action == "show":
        if not args.key:
            raise UsageError("ejkfn cache show needs a KEY (see `ejkfn cache ls`)")
        record = store.record(args.key)
        if record is None:
            raise UsageError(f"no entry {args.key!r} in {store.path}")
        print(json.dumps(record, indent=2, sort_keys=True, default=str))
    elif action == "export":
        if not args.file:
            raise UsageError("ejkfn cache export needs a FILE")
        count = store.export(args.file)
        print(f"exported {count} entries to {args.file}")
    elif action in ("import", "merge"):
        if not args.file:
            raise UsageError(
                f"ejkfn cache {action} needs a {'FILE' if action == 'import' else 'DIR'}"
            )
        source = Path(args.file)
        if action == "merge":
            if not source.is_dir():
                raise UsageError(f"merge takes a cache directory; {str(source)!r} is not one")
            other = ejkfn.PersistentCache(source, readonly=True)
            for key in other.keys():
                record = other.record(key) or {}
                cfg = other.get(key)
                if cfg is not None:
                    store = store.put(key, cfg, meta=record.get("meta"))
        else:
            try:
                store = store.import_file(source)
            except ValueError as exc:
                raise UsageError(str(exc)) from exc
        count = len(store.pending)
        store = store.save()
        print(f"{action}d {count} entries into {store.path}")
    elif action == "clear":
        keys = sorted(k for k in store.keys() if not args.kernel or k.startswith(f"{args.kernel}/"))
        if not keys:
            print("nothing to clear")
            return 0
        if not args.yes:
            if not sys.stdin.isatty():
                raise UsageError(
                    f"refusing to delete {len(keys)} entries without --yes (no terminal)"
                )
            answer = input(f"delete {len(keys)} entries from {store.path}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing deleted")
                return 1
        store = store.remove(keys) if args.kernel else store.clear()
        print(f"deleted {len(keys)} entries")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ejkfn", description="ejkfn: tune JAX kernels and manage their config cache."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    tune = sub.add_parser(
        "tune",
        help="autotune kernels and save the chosen configs",
        description="Autotune a kernel for the given shapes (or a built-in workload) "
        "and save the chosen configs to the persistent cache.",
    )
    tune.add_argument(
        "kernel",
        nargs="?",
        help=f"kernel to tune: {', '.join(sorted(KERNELS))} (none: a built-in workload)",
    )
    tune.add_argument(
        "--shape",
        type=_shape,
        help="argument shape, comma-separated "
        "(flash_attention: BATCH,SEQ,HEADS,DIM; scale: ROWS,COLS)",
    )
    tune.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    tune.add_argument("--causal", action="store_true", help="causal attention")
    tune.add_argument("--kv-heads", type=int, help="key/value heads for GQA (default: heads)")
    tune.add_argument("--platform", default="auto", help="attention platform (default: auto)")
    tune.add_argument("--backward", action="store_true", help="time forward plus backward")
    tune.add_argument("--warmup", type=int, default=2, help="untimed calls per candidate")
    tune.add_argument("--iters", type=int, default=10, help="timed calls per candidate (median)")
    tune.add_argument(
        "--runoff",
        type=float,
        default=0.0,
        help="time the candidates within this fraction of the fastest again, among themselves, "
        "with twice the calls (e.g. 0.03; default 0: off)",
    )
    tune.add_argument(
        "--cache-dir",
        help="persistent cache directory (default: $EJKFN_CACHE_DIR or ~/.cache/ejkfn)",
    )
    tune.add_argument("--no-save", action="store_true", help="do not write the persistent cache")
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    tune.set_defaults(run=_cmd_tune)

    cache = sub.add_parser(
        "cache",
        help="inspect and edit the persistent config cache",
        description="Inspect and edit the persistent config cache.",
    )
    cache.add_argument(
        "action",
        choices=["path", "ls", "show", "export", "import", "merge", "clear"],
        help="path: where it is; ls: list entries; show KEY: one entry; export FILE; "
        "import FILE; merge DIR (another cache directory); clear: delete entries",
    )
    cache.add_argument("key", nargs="?", help="entry key (show)")
    cache.add_argument("--file", help="file (export/import) or directory (merge)")
    cache.add_argument("--kernel", help="only entries of this kernel (ls, clear)")
    cache.add_argument("--yes", action="store_true", help="do not ask before deleting")
    cache.add_argument(
        "--cache-dir",
        help="persistent cache directory (default: $EJKFN_CACHE_DIR or ~/.cache/ejkfn)",
    )
    cache.set_defaults(run=_cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ejkfn`` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    if (
        getattr(args, "action", None) in ("export", "import", "merge")
        and args.file is None
        and args.key
    ):
        args.file = args.key  # `ejkfn cache export FILE` reads naturally
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"ejkfn: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
