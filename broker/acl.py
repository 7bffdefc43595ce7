"""Redis ACL users for one run, one per role, each with the least it needs.

=========  ===================================================================================
role       may
=========  ===================================================================================
learner    append to the run's fragment streams with XADD only (and read them back: a
           restarted learner checks which of its pushes arrived); write its heartbeat (the
           ``learners`` hash, its ``hb:<id>`` key), claim its epoch (``epoch:<id>``), events
           and end-of-run reports; read the
           configuration, the syncer endpoints, global values and snapshots, its refusals,
           the stop/finish flags, which of its pushes were merged.
           Nothing else: no syncer state, leases, round records, dead letters, configuration
           writes, or any key of another run.
syncer     every fragment key of the run (streams, consumer group, state, global values,
           snapshots, rounds, dead letters, leases), the syncer endpoints and membership,
           events, end-of-run reports, refusals and merge records; read the configuration,
           heartbeats and stop/finish flags.
reader     read every key of the run (``status``, ``inspect``, ``replay``, ``export``, ``plot``).
operator   every key of the run (``init``, ``stop``, ``finish``, deleting a run).
=========  ===================================================================================

Every role gets the data commands only (no ``@admin``, no ``@dangerous``: no CONFIG, FLUSHALL,
KEYS, DEBUG, ACL …), read-only views of a Redis Cluster's slot map (``CLUSTER
INFO|SLOTS|SHARDS|NODES|MYID``: what a cluster client reads) and ``TIME``, and no Pub/Sub
channels. On a cluster, `apply` writes the users to every node.

Limits of Redis ACLs, stated: a hash is one key, so a learner allowed to write its heartbeat
in the shared ``learners`` hash can write another learner's field too (records are validated
when read, and the heartbeat is what the learner itself declares); a learner may append
entries in another learner's name to the run's streams (signed contributions, not ACLs, are
what stops that); and a learner, which claims its own epoch when it joins (``epoch:<id>``), can
raise another learner's epoch counter too (never set it back): in an unsigned run that makes
the other learner stand down, like overwriting its heartbeat disturbs it; in a signed run only
claims signed with the learner's key count (``epochsig:<id>``), so it changes nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import urllib.parse
from dataclasses import dataclass

from broker.keys import PREFIX, RunKeys, check_run_name

ROLES = ("learner", "syncer", "reader", "operator")

# FUNCTION FLUSH/DELETE/LOAD/RESTORE are @write (server-wide): out with the rest of FUNCTION
_DATA = ["+@read", "+@write", "+@stream", "+@hash", "+@string", "+@keyspace",
         "+@transaction", "-@dangerous", "-@admin", "-function"]


# A Redis Cluster's slot map and state, which every client reads to find the node of a key
# (read-only; a standalone server answers them with an error): the roles work on a cluster.
# And the server's clock (`diloco inspect` measures ages against it).
_TOPOLOGY = ["+cluster|info", "+cluster|slots", "+cluster|shards", "+cluster|nodes",
             "+cluster|myid", "+time"]


def user_name(run: str, role: str) -> str:
    """The ACL user of `role` in `run` (``diloco-<run>-<role>``)."""
    return f"diloco-{check_run_name(run)}-{role}"


def key_rules(run: str, role: str) -> list[str]:
    """The key patterns of `role` (``~`` read and write, ``%R~`` read, ``%W~`` write)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    keys = RunKeys(run)
    frag = f"{PREFIX}:{{{run}/f*}}"  # every fragment of the run (names hold no glob character)
    legacy = f"%R~{keys.legacy_config}"  # every process checks that no old-style run is there
    everything = [f"~{PREFIX}:{{{run}}}:*", f"~{frag}:*"]
    if role == "operator":
        return [*everything, legacy]
    if role == "reader":
        return [f"%R~{PREFIX}:{{{run}}}:*", f"%R~{frag}:*", legacy]
    read = [f"%R~{k}" for k in (keys.config, keys.stop, keys.finish)]
    if role == "syncer":
        return [*read, legacy, f"%R~{keys.learners}", f"%R~{keys.heartbeat('*')}",
                f"~{keys.syncers}", f"~{keys.members}", f"~{keys.member('*')}",
                f"~{keys.events}", f"~{keys.done}",
                f"~{keys.refused}", f"~{frag}:*"]
    return [*read, legacy, f"%R~{keys.syncers}", f"%R~{keys.refused}",
            f"%R~{frag}:merged", f"%R~{frag}:global", f"%R~{frag}:sent:*", f"%R~{frag}:frags",
            f"~{keys.learners}", f"~{keys.heartbeat('*')}", f"~{keys.done}",
            f"%W~{keys.events}"]


def selectors(run: str, role: str) -> list[str]:
    """Redis 7 selectors: rights on other keys than the root rules', each for a few commands.
    A learner may only XADD to the fragment streams (not XACK, XDEL, XTRIM, XGROUP, XCLAIM,
    XREADGROUP or DEL: the syncers' consumer group is theirs), only read and raise the
    learner epoch counters (no SET or DEL: an epoch never goes back) and only add and read
    signed epoch claims."""
    if role != "learner":
        return []
    keys = RunKeys(run)
    return [f"(~{PREFIX}:{{{run}/f*}}:frags +xadd)",
            f"(~{keys.epoch('*')} +get +incr +incrby)",
            f"(~{keys.epoch_sig('*')} +hset +hmget)"]


def rules(run: str, role: str) -> list[str]:
    """Every rule of `role` after its password: on, reset, commands, keys, no channels."""
    commands = (["-@all", "+@connection", "+@read", "-@dangerous", "-@admin", *_TOPOLOGY]
                if role == "reader" else
                ["-@all", "+@connection", *_DATA, *_TOPOLOGY, *(
                    # the lease script (EVALSHA, loaded by SCRIPT LOAD); not @scripting, which
                    # holds server-wide SCRIPT FLUSH and FUNCTION DELETE
                    ["+eval", "+evalsha", "+script|load"] if role in ("syncer", "operator")
                    # the consumer-group commands whose key spec only asks for read access
                    # (XREADGROUP is "RO" in Redis 7.0): not a learner's business
                    else ["-xreadgroup", "-xautoclaim", "-xclaim", "-xack", "-xgroup",
                          "-xsetid"])])
    return ["on", "resetpass", "resetkeys", "resetchannels", "clearselectors", *commands,
            *key_rules(run, role), *selectors(run, role)]


@dataclass(frozen=True)
class RoleUser:
    role: str
    name: str
    password: str  # plaintext: goes only into the role's URL file

    def setuser(self, run: str) -> list[str]:
        """``ACL SETUSER`` arguments; the password only as its SHA-256 (``#…``)."""
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        return ["ACL", "SETUSER", self.name, *rules(run, self.role)[:2], f"#{digest}",
                *rules(run, self.role)[2:]]

    def url(self, base_url: str) -> str:
        """`base_url` (scheme, host, port, db, query) with this user and password."""
        parts = urllib.parse.urlsplit(base_url)
        host = parts.netloc.rpartition("@")[2]
        auth = f"{urllib.parse.quote(self.name, safe='')}:" \
               f"{urllib.parse.quote(self.password, safe='')}@"
        return urllib.parse.urlunsplit((parts.scheme, auth + host, parts.path, parts.query, ""))


def apply(r, run: str, users: list[RoleUser]) -> list[str]:
    """Create (or reset) the users on `r`'s server — on every node, primaries and replicas
    (from ``CLUSTER NODES``), when `r` is a Redis Cluster client: each node keeps its own
    users, and a replica promoted by a failover must know them. Returns the nodes written
    (``host:port``; one entry ``""`` for a standalone server)."""
    import redis
    from redis.cluster import RedisCluster

    if not isinstance(r, RedisCluster):
        for u in users:
            r.execute_command(*u.setuser(run))
        return [""]
    kw = {k: v for k, v in r.nodes_manager.connection_kwargs.items()
          if k not in ("host", "port", "retry", "retry_on_error")}
    raw = r.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    done = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or "fail" in parts[2].split(",") or "noaddr" in parts[2]:
            continue
        host, _, port = parts[1].split("@")[0].rpartition(":")
        node = redis.Redis(host=host, port=int(port), **kw)
        try:
            for u in users:
                node.execute_command(*u.setuser(run))
        finally:
            node.close()
        done.append(f"{host}:{port}")
    return done


def new_users(run: str) -> list[RoleUser]:
    """One user per role with a fresh random password (256 bits)."""
    return [RoleUser(role, user_name(run, role), secrets.token_urlsafe(32)) for role in ROLES]


def command_line(args: list[str]) -> str:
    """One redis-cli line of `args` (quoted where needed)."""
    return " ".join(a if a and all(c.isalnum() or c in "-_:@#%~*/.+>{}|"
                                   for c in a) else f'"{a}"' for a in args)
