"""`diloco acl`: one Redis ACL user per role of a run, least privilege (broker/acl.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import redis

from broker import acl, signing
from broker.connection import connect, redact
from broker.keys import check_run_name
from ops.cli.common import fail, fail_on
from ops.cluster import write_keys, write_role_urls
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
    k = sub.add_parser("keys", help="ZeroMQ CURVE key pairs and signing keys of a run's "
                       "syncers and learners")
    k.add_argument("--out", required=True, metavar="DIR")
    k.add_argument("--learners", required=True, metavar="ID,ID,...",
                   help="the learner ids, e.g. L0,L1,L2 (more can be added later with --add)")
    k.add_argument("--add", action="store_true",
                   help="only add the learners' keys (keep the syncer key pair in DIR)")
    k.set_defaults(func=_keys)


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
        write_role_urls(out, users, args.url)
    except OSError as e:
        return fail(f"--out {out}: {e.strerror or e}")
    try:  # the same users as an aclfile for a redis-server that loads one (--aclfile)
        signing.write_private(out / "users.acl", "".join(
            "user " + " ".join(u.setuser(run)[2:]) + "\n" for u in users))
    except OSError as e:
        return fail(f"--out {out}: {e.strerror or e}")
    for u in users:
        print(acl.command_line(u.setuser(run)))
    if args.apply:
        try:
            r = connect(args.redis_url)
            acl.apply(r, run, users)
        except (redis.RedisError, ValueError) as e:
            return fail_on(e)
        print(f"# applied to {redact(args.redis_url)} (every node of a cluster); run ACL SAVE "
              f"there if it uses an aclfile")
    print(f"# role URLs written to {out}/{{{','.join(acl.ROLES)}}}.url (mode 600), the users "
          f"as an aclfile to {out}/users.acl")
    return 0


def _keys(args: argparse.Namespace) -> int:
    ids = [x.strip() for x in args.learners.split(",") if x.strip()]
    bad = [x for x in ids if not x.replace("-", "").replace("_", "").replace(".", "").isalnum()]
    if not ids or bad:
        return fail(f"--learners: expected ids of letters, digits, '.', '_', '-'; got "
                    f"{args.learners!r}")
    out = Path(args.out)
    try:
        made = write_keys(out, ids, syncer=not args.add)
    except (OSError, ValueError) as e:
        return fail(f"--out {out}: {e}")
    for line in made:
        print(line)
    return 0
