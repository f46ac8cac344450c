"""`kvstash <command>`: argument parsing and one-line errors; each command lives in its part.

An error is one line on stderr and a non-zero exit; `--verbose` (before or after the command)
also logs at INFO level and prints the error's traceback.

A command module exposes `add_arguments(parser)` and `run(args) -> int` and must not
import torch at module level (the server host has none).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
import traceback

from storage.errors import StoreError

# (command words, module, one-line help)
COMMANDS = [
    (("demo",), "bench.demo", "end-to-end demo: kvserver + a real model, TTFT cold vs warm"),
    (("serve",), "kvserver.cli", "serve a store over HTTP"),
    (("ls",), "storage.admin:ls", "list the keys of a store"),
    (("stat",), "storage.admin:stat", "show a store's stats (or one key's header)"),
    (("gc",), "storage.admin:gc", "evict least-recently-used chunks down to a capacity"),
    (("bench", "store"), "bench.store", "store put/get GB/s against a raw baseline"),
    (("bench", "ttft"), "bench.ttft", "TTFT of miss vs hit vs ideal on a real model"),
    (("bench", "trace"), "bench.trace", "replay a request trace through a real store"),
    (("bench", "gds"), "bench.gds", "verify and time each chunk-read path (GDS, pinned, CPU)"),
    (("bench", "vllm"), "bench.vllm", "TTFT through a real vLLM engine: no cache, its own prefix cache, kvstash"),
    (("bench", "vllm-pd"), "bench.vllm_pd", "prefill/decode disaggregation through a shared store, in real vLLM engines"),
    (("bench", "vllm-chat"), "bench.vllm_chat", "multi-turn chats through real vLLM engines, each turn to the other engine: replies saved or not"),
    (("bench", "vllm-layers"), "bench.vllm_layers", "a vLLM hit with whole-prefix against layer-pipelined loads, on a shaped store"),
    (("bench", "vllm-gpu-worker"), "bench.vllm_gpu_worker", "the vLLM connector's worker on a GPU: loads beside a step's compute"),
    (("bench", "events"), "bench.events", "kvserver PUTs/s with /v1/events subscribers against none"),
    (("bench", "soak"), "bench.soak", "faults, load and hostile input against stores and server"),
    (("doctor",), "kvstash.doctor", "what makes a deployment slow or unsafe: store, mounts, tokens, server"),
    (("plan",), "bench.plan", "capacity -> hit rate -> TTFT saved, and break-even bandwidth"),
]


VERBOSE_HELP = "log at INFO level and print the traceback of an error"


def _load(target: str):
    module, _, prefix = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise
    add = getattr(mod, f"add_{prefix}_arguments" if prefix else "add_arguments")
    run = getattr(mod, f"run_{prefix}" if prefix else "run")
    return add, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstash", description="External KV-cache server for LLM inference."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, target, help_text in COMMANDS:
        loaded = _load(target)
        if loaded is None:
            continue
        add, run = loaded
        subs = top
        if len(words) == 2:
            if words[0] not in groups:
                group = top.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            subs = groups[words[0]]
        p = subs.add_parser(words[-1], help=help_text, description=help_text)
        add(p)
        if not any("--verbose" in a.option_strings for a in p._actions):
            # Also after the command; SUPPRESS keeps a `-v` given before it.
            p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                           help=VERBOSE_HELP)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        result = args._run(args)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return int(result or 0)
    except KeyboardInterrupt:
        return 130
    except (StoreError, ValueError, OSError, RuntimeError) as exc:
        # ConfigError, StoreError and friends: one line; the traceback only with --verbose.
        if args.verbose:
            traceback.print_exc()
        print(f"kvstash: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
