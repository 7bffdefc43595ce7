"""`diloco acl`: one Redis ACL user per role of a run, least privilege (broker/acl.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import redis

from broker import acl
from broker.connection import connect, redact
from broker.keys import check_run_name
from ops.cli.common import fail, fail_on
from workers.common import add_redis_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("acl", help="Redis ACL users of a run, one per role (least privilege)")
    p.add_argument("--run", required=True)
    p.add_argument("--url", required=True, metavar="redis[s]://HOST:PORT/DB",
                   help="how the roles reach Redis (no user or password: each role's URL "
                        "gets its own)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="write each role's URL (with its new password) to DIR/<role>.url, "
                        "mode 600; hand each file only to the hosts of that role")
    p.add_argument("--apply", action="store_true",
                   help="run the ACL SETUSER lines on the server (needs an admin URL: "
                        "--redis-url-file or $DILOCO_REDIS_URL)")
    add_redis_args(p, required=False, help="admin URL for --apply")
    p.set_defaults(func=_acl)


def _acl(args: argparse.Namespace) -> int:
    try:
        run = check_run_name(args.run)
    except ValueError as e:
        return fail(str(e))
    if args.apply and not args.redis_url:
        return fail("--apply needs an admin URL (--redis-url-file FILE or $DILOCO_REDIS_URL)")
    users = acl.new_users(run)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for u in users:
            path = out / f"{u.role}.url"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(u.url(args.url) + "\n")
            os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    except OSError as e:
        return fail(f"--out {out}: {e.strerror or e}")
    for u in users:
        print(acl.command_line(u.setuser(run)))
    if args.apply:
        try:
            r = connect(args.redis_url)
            for u in users:
                r.execute_command(*u.setuser(run))
        except (redis.RedisError, ValueError) as e:
            return fail_on(e)
        print(f"# applied to {redact(args.redis_url)}; run ACL SAVE there if it uses an aclfile")
    print(f"# role URLs written to {out}/{{{','.join(acl.ROLES)}}}.url (mode 600)")
    return 0
