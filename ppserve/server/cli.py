"""`ppserve serve | generate | stats`: run the server (gRPC and OpenAI-compatible HTTP), stream a completion
over gRPC, print server statistics.

Heavy imports (torch, ray, grpc) happen inside the run functions so `ppserve --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ppserve.config import add_config_arguments

if TYPE_CHECKING:  # the stats type only: `ppserve --help` stays instant
    from ppserve.engine.stats import EngineStats


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the gRPC API (ppserve.v1) and the OpenAI-compatible HTTP API "
                                     "on a pipeline")
    add_config_arguments(p)
    p.add_argument("--host", help="address to bind (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: server.port, 50051; 0 picks a free one)")
    p.add_argument("--http-port", type=int,
                   help="port of the OpenAI-compatible HTTP API and /metrics "
                        "(default: server.http_port, 8000; 0 picks a free one, -1 turns it off)")
    p.add_argument(
        "--ray-address", help="attach to this Ray cluster (e.g. auto or HEAD:6379) instead of starting one"
    )
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template that replaces the model's (default: model.chat_template)")
    r = p.add_argument_group("replicas (Ray Serve; docs/serving.md#replicas)")
    r.add_argument("--replicas", type=_replica_count, default=1,
                   help="pipelines behind the one endpoint: a count, or auto (Serve's autoscaler between "
                        "--min-replicas and --max-replicas); 1 is a single server, without Serve")
    r.add_argument("--min-replicas", type=int, default=1)
    r.add_argument("--max-replicas", type=int, default=1)
    r.add_argument("--target-ongoing-requests", type=float,
                   help="requests per replica the autoscaler aims at (with --replicas auto)")
    r.add_argument("--routing", default="prefix", choices=("prefix", "round-robin", "power-of-two"),
                   help="how a request picks its replica: the one holding its prompt's prefix (unless it is "
                        "much busier), in turn, or the less loaded of two")
    p.set_defaults(func=run_serve)

    g = sub.add_parser("generate", help="stream one completion from a running server")
    g.add_argument("prompt")
    g.add_argument("--server", default="127.0.0.1:50051", help="host:port of the server")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None,
                   help="keep tokens at least this times as likely as the most likely one, in [0, 1]")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); not included in the output")
    g.add_argument("--stop-token-ids", type=_int_list, default=(), metavar="ID[,ID...]",
                   help="token ids that end the request")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    _add_security_args(g)
    g.set_defaults(func=run_generate)

    s = sub.add_parser("stats", help="print a running server's statistics")
    s.add_argument("--server", default="127.0.0.1:50051", help="host:port of the server")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_security_args(s)
    s.set_defaults(func=run_stats)


def _replica_count(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or auto, got {text!r}")
    return n


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _add_security_args(p: Any) -> None:
    p.add_argument("--tls-ca",
                   help="PEM file of the CA (or self-signed certificate) to trust: connect with TLS")
    p.add_argument("--token-file", help="file holding the server's bearer token")


def _client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from pathlib import Path

    token = Path(args.token_file).read_text().strip() if args.token_file else None
    return {"root_certificates": args.tls_ca, "token": token}


def run_serve(args: argparse.Namespace) -> int:
    from ppserve.config import load_config
    from ppserve.server.server import run_server

    # The flags are shorthands for settings; an empty address or host is no setting, port 0 is one.
    flags = {"parallel.ray_address": args.ray_address or None, "server.host": args.host or None,
             "server.port": args.port, "server.http_port": args.http_port,
             "model.chat_template": args.chat_template or None}
    overrides = [*args.overrides, *(f"{key}={value}" for key, value in flags.items() if value is not None)]
    if args.replicas != 1:
        from ppserve.deploy.local import run_replicas

        deploy: dict[str, Any] = {"config": args.config, "set": overrides, "replicas": args.replicas,
                                  "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                                  "routing": args.routing}
        if args.target_ongoing_requests is not None:
            deploy["target_ongoing_requests"] = args.target_ongoing_requests
        return run_replicas(deploy)
    config = load_config(args.config, overrides)
    return run_server(config, config.server.host, config.server.port)


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from ppserve.request import SamplingParams
    from ppserve.server.client import PPServeClient

    kwargs: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "stop": tuple(args.stop), "stop_token_ids": args.stop_token_ids,
                              "ignore_eos": args.ignore_eos}
    for name in ("top_p", "top_k", "min_p", "seed"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    sampling = SamplingParams(**kwargs)
    try:
        sampling.validate()
    except ValueError as e:
        print(f"ppserve generate: {e}", file=sys.stderr)
        return 2
    with PPServeClient(args.server, **_client_kwargs(args)) as client:
        try:
            if args.chat:
                stream = client.stream(
                    messages=[{"role": "user", "content": args.prompt}],
                    sampling=sampling,
                    timeout=args.timeout,
                )
            else:
                stream = client.stream(args.prompt, sampling=sampling, timeout=args.timeout)
            last = None
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as e:
            print(f"\nppserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            stream.cancel()
            raise
    print()
    if last is not None and last.metrics is not None:
        m = last.metrics
        print(
            f"[{last.num_output_tokens} tokens, {last.finish_reason}; "
            f"queue {m['queue_time_s'] * 1e3:.1f} ms, "
            f"TTFT {m['ttft_s'] * 1e3:.1f} ms, mean TBT {m['mean_tbt_s'] * 1e3:.1f} ms]",
            file=sys.stderr,
        )
    return 0


def format_stats(s: EngineStats) -> str:
    """GetStats as a human-readable table."""
    c = s.config
    lines = [
        f"model        {c.model}",
        f"parallel     pp={c.pipeline_parallel_size} tp={c.tensor_parallel_size}   "
        f"policy {c.policy}, token budget {c.token_budget}, block size {c.block_size}, "
        f"max_model_len {c.max_model_len}",
        f"requests     running {s.running}  waiting {s.waiting}  in-flight microbatches "
        f"{s.in_flight_microbatches}  finished {s.requests_finished}",
        f"kv blocks    {s.kv_blocks_used} / {s.kv_blocks_total} used   preemptions {s.num_preemptions}",
        f"prefix cache {s.prefix_cache_hit_rate * 100:.1f}% hit ({s.prefix_cache_hits} of "
        f"{s.prefix_cache_queries} prompt tokens)   {s.kv_blocks_cached} blocks cached",
        *([f"speculation  {s.spec_decode_num_drafts} drafts: {s.spec_decode_num_accepted_tokens} of "
           f"{s.spec_decode_num_draft_tokens} draft tokens accepted "
           f"({s.spec_decode_acceptance_rate * 100:.1f}%), "
           f"mean acceptance length {s.spec_decode_mean_acceptance_length:.2f}; per position "
           + " / ".join(str(n) for n in s.spec_decode_num_accepted_tokens_per_pos)] if s.speculated else []),
        f"throughput   {s.tokens_per_s:.1f} tok/s over the last {s.window_s:.1f} s   "
        f"({s.tokens_generated} tokens since start, up {s.uptime_s:.0f} s)",
        f"recovery     {s.num_restarts} pipeline restart(s)"
        + (f", last took {s.last_recovery_s:.2f} s, {s.total_recovery_s:.2f} s in all"
           if s.num_restarts else ""),
        "",
        f"{'stage':>5} {'busy%':>7} {'bubble%':>8} {'starve%':>8}",
    ]
    for st in s.stages:
        lines.append(
            f"{st.stage:>5} {st.busy_fraction * 100:>6.1f}% {st.bubble_fraction * 100:>7.1f}% "
            f"{st.starvation_fraction * 100:>7.1f}%"
        )
    if not s.stages:
        lines.append("  (no stage activity in the window)")
    lines.append(f" mean bubble {s.mean_bubble_fraction * 100:.1f}% (window: last {s.window_s:.1f} s)")
    lines += ["", f"{'stage':>5} {'tp':>3} {'layers':>9}  {'node_ip':<15} {'pid':>8}  node_id"]
    for w in s.workers:
        lines.append(
            f"{w.stage:>5} {w.tp_rank:>3} {w.layer_start:>4}-{w.layer_end:<4}  "
            f"{w.node_ip:<15} {w.pid:>8}  {w.node_id[:16]}"
        )
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    import json

    import grpc

    from ppserve.server.client import PPServeClient

    with PPServeClient(args.server, **_client_kwargs(args)) as client:
        try:
            s = client.stats()
        except grpc.RpcError as e:
            print(f"ppserve stats: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(json.dumps(s.to_dict(), indent=2) if args.json else format_stats(s))
    return 0
