"""`ppserve` command line: serve | generate | stats | demo | bench | timeline | simulate | plan | offline.

Each subcommand lives in its own module exposing `add_parser(subparsers)`; those modules import
heavy packages (torch, ray, grpc) only inside their run functions, so `ppserve --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module that defines add_parser(); modules are imported lazily when present.
_COMMANDS = {
    "offline": "ppserve.engine.offline_cli",
    "serve": "ppserve.server.cli",
    "generate": "ppserve.server.cli",
    "stats": "ppserve.server.cli",
    "demo": "ppserve.server.demo",
    "bench": "ppserve.bench.cli",
    "timeline": "ppserve.timeline.cli",
    "simulate": "ppserve.sim.cli",
    "plan": "ppserve.plan.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    seen: set[str] = set()
    for module_name in dict.fromkeys(_COMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # that part of ppserve is not built yet
            raise
        module.add_parser(sub)
        seen.add(module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rc: int = args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ppserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
