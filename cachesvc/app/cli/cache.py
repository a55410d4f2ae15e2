"""`cachesvc cache`: explicit cache control of a running router, over gRPC.

`prewarm` computes and keeps a prompt's KV (Cache.Prewarm), `close-session` demotes what a
session retained (Cache.CloseSession); a tenant's token acts on its own tenant. `quota` and
`usage` are the operator's (Admin.SetTenantQuota, Admin.TenantUsage). Each prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cachesvc.app.cli.common import CliError, client_tls, read_token


def add_cache_parser(sub: Any) -> None:
    """Register the `cache` subcommand (and its verbs) on the CLI's subparsers."""
    p = sub.add_parser("cache", help="prewarm prompts, close sessions, set tenant quotas")
    verbs = p.add_subparsers(dest="verb", required=True)
    warm = verbs.add_parser("prewarm", help="compute and keep a prompt's KV on a worker")
    warm.add_argument("--prompt", required=True, help="the prompt text")
    warm.add_argument("--chat", action="store_true", help="the prompt is a user turn of a chat")
    warm.add_argument("--system", help="with --chat: a system turn before it")
    warm.add_argument("--retention-s", type=int, help="keep it this many seconds (soft)")
    warm.add_argument("--session", help="tag it with this cache session")
    warm.add_argument("--cache-salt", help="the salt its requests will send")
    close = verbs.add_parser("close-session", help="demote the blocks a session retained")
    close.add_argument("session_id", metavar="ID")
    quota = verbs.add_parser("quota", help="set a tenant's quota (the operator's token)")
    quota.add_argument("--tenant", required=True, help='the tenant ("" : requests without one)')
    quota.add_argument("--share", type=float, default=1.0, help="soft share of each tier")
    quota.add_argument(
        "--max-retention", default="24h", help="longest retention it may ask: seconds, 5m, 1h"
    )
    quota.add_argument(
        "--retention-share", type=float, default=0.5, help="share of each tier it may retain"
    )
    verbs.add_parser("usage", help="each tenant's cached and retained blocks per tier")
    for verb in (warm, close, quota, verbs.choices["usage"]):
        _add_connection_flags(verb)


def _add_connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", required=True, metavar="HOST:PORT", help="the router's gRPC address")
    p.add_argument("--auth-token-file", help="bearer token for the router (a file holding it)")
    p.add_argument("--tls-ca-file", help="speak TLS, trusting this PEM CA")
    p.add_argument("--tls-cert-file", help="mutual TLS: this client's PEM certificate")
    p.add_argument("--tls-key-file", help="mutual TLS: the PEM private key of --tls-cert-file")


def run_cache_command(args: argparse.Namespace) -> int:
    """Run one `cache` verb against `--addr`; print its answer as JSON."""
    from router.grpc.client import RemoteError, RouterClient, make_prompt

    with RouterClient(args.addr, read_token(args.auth_token_file), client_tls(args)) as client:
        try:
            if args.verb == "prewarm":
                out: Any = client.prewarm(
                    make_prompt(args.prompt, args.chat, args.system),
                    retention_s=args.retention_s,
                    session_id=args.session,
                    cache_salt=args.cache_salt,
                )
            elif args.verb == "close-session":
                released = client.close_session(args.session_id)
                out = {"session_id": args.session_id, "num_blocks_released": released}
            elif args.verb == "quota":
                out = client.set_tenant_quota(
                    args.tenant, args.share, _seconds(args.max_retention), args.retention_share
                )
            else:
                out = {"tenants": client.tenant_usage()}
        except RemoteError as exc:
            raise CliError(f"--addr {args.addr}: {exc}") from exc
    print(json.dumps(out))
    return 0


def _seconds(value: str) -> int:
    from router.tenants import parse_retention

    try:
        return parse_retention(value)
    except ValueError as exc:
        raise CliError(f"--max-retention {exc}") from None
