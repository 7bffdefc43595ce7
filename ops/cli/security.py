"""`diloco acl`: one Redis ACL user per role of a run, least privilege (broker/acl.py);
`diloco keys`: the run's CURVE and signing keys; `diloco secure init`: an evaluation Redis's
certificates, configuration and admin user."""

from __future__ import annotations

import argparse
from pathlib import Path

import redis

from broker import acl, signing
from broker.connection import connect, redact
from broker.keys import check_run_name
from ops.cli.common import fail, fail_on
from ops.cluster import secure_init, write_bundles, write_keys, write_role_urls
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
    b = sub.add_parser("bundle", help="one folder per host role with exactly the files that "
                       "host needs (URL file, TLS files, keys) and the command it runs")
    b.add_argument("--acl", required=True, metavar="DIR", help="what diloco acl wrote")
    b.add_argument("--keys", required=True, metavar="DIR", help="what diloco keys wrote")
    b.add_argument("--learners", required=True, metavar="ID,ID,...")
    b.add_argument("--out", required=True, metavar="DIR", help="a new folder")
    b.set_defaults(func=_bundle)
    s = sub.add_parser("secure", help="the hardened Redis's files (secure init)")
    ssub = s.add_subparsers(dest="secure_command", required=True)
    i = ssub.add_parser("init", help="a CA, server and client certificates, a TLS-only "
                        "redis.conf, an ACL file with an admin user, and admin.url",
                        description="For evaluation and small deployments: your own CA's "
                        "certificates work as well (docs/SECURITY.md).")
    i.add_argument("--out", required=True, metavar="DIR", help="a new folder (never overwritten)")
    i.add_argument("--redis-host", required=True, metavar="HOST[,HOST...]",
                   help="the names or addresses learners and syncers use to reach Redis (in "
                        "the server certificate; the first goes into admin.url)")
    i.add_argument("--port", type=int, default=6380, help="Redis's TLS port (default 6380)")
    i.add_argument("--days", type=int, default=365, help="certificate validity (default 365)")
    i.set_defaults(func=_secure_init)


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


def _learner_ids(text: str) -> list[str] | None:
    ids = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in ids if not x.replace("-", "").replace("_", "").replace(".", "").isalnum()
           or x.startswith(".")]
    return None if not ids or bad else ids


def _bundle(args: argparse.Namespace) -> int:
    ids = _learner_ids(args.learners)
    if ids is None:
        return fail(f"--learners: expected ids of letters, digits, '.', '_', '-'; got "
                    f"{args.learners!r}")
    try:
        lines = write_bundles(Path(args.acl), Path(args.keys), Path(args.out), ids)
    except (OSError, ValueError) as e:
        return fail(str(e))
    for line in lines:
        print(line)
    return 0


def _keys(args: argparse.Namespace) -> int:
    ids = _learner_ids(args.learners)
    if ids is None:
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


def _secure_init(args: argparse.Namespace) -> int:
    hosts = [h.strip() for h in args.redis_host.split(",") if h.strip()]
    if not hosts:
        return fail("--redis-host: expected one or more host names or addresses")
    if not 1 <= args.port <= 65535 or not 1 <= args.days <= 3650:
        return fail("--port must be 1-65535 and --days 1-3650")
    try:
        made = secure_init(Path(args.out), hosts, args.port, args.days)
    except ValueError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"--out {args.out}: {e.strerror or e}")
    for line in made:
        print(line)
    return 0
