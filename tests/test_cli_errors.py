"""An operator's mistake or an unreachable service costs one line on stderr and exit code 2,
never a traceback: every path below printed one before."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from ops.cli import main
from ops.cluster import free_port


@pytest.fixture(scope="module")
def not_redis():
    """A TCP port that answers like a web server, not like Redis."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
    stop.set()
    thread.join(5)
    srv.close()


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """`diloco syncer`/`learner` configure logging in this process: undo it after each case."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="module")
def down():
    """A Redis URL on a port nothing listens on."""
    return f"redis://127.0.0.1:{free_port()}/0"


CASES = [
    ("status --redis-url notaurl --run x", "Redis URL must specify"),
    ("status --redis-url DOWN --run x", "Redis did not answer"),
    ("status --redis-url NOTREDIS --run x", "does not reach a Redis server"),
    ("inspect --redis-url DOWN --run x", "Redis did not answer"),
    ("export --redis-url DOWN --run x --out OUT/x.npz", "Redis did not answer"),
    ("syncer --redis-url DOWN --run x", "Redis did not answer"),
    ("learner --redis-url DOWN --run x", "Redis did not answer"),
    ("run --redis-url DOWN --run x --steps 5 --out OUT", "Redis did not answer"),
    ("status --redis-url DOWN --run a b", "run name 'a b'"),
    ("status --redis-url DOWN --run x{y", "run name 'x{y'"),
    ("run --engine inprocess --run a*b --out OUT", "run name 'a*b'"),
    ("init --redis-url DOWN --run x --config OUT/missing.toml", "missing.toml"),
    ("chaos --config OUT/missing.toml --out OUT", "missing.toml"),
    ("run --engine inprocess --out OUT --set engine.failures=[[0,\"a\",1]]",
     "engine.failures: bad failure"),
    ("plot OUT/no-run", "no such file"),
    ("run --engine inprocess --out OUT --set task=llama --set model.d_model=20 "
     "--set model.n_heads=4", "even head width"),
    ("run --engine inprocess --out OUT --set task=gpt5", "task"),
    ("run --engine inprocess --out OUT --set sync.fragments=99", "fragments"),
    ("status --redis-url DOWN-DB99 --run x", "Redis"),
    ("chaos --out OUT --spare-after-s 3", "needs --spares"),
    ("chaos --out OUT --spares --spare-after-s nan", "finite"),
    ("bench s1 --out OUT --spares --spare-after-s -1", ">= 0"),
    ("bench s1 --out OUT --checkpoint-every -2", "--checkpoint-every"),
    ("bench s1 --out OUT --modes decoupled,ddp", "--modes"),
    ("bench s2 --out OUT --set outer.momentum=1.5", "outer.momentum"),
]


@pytest.mark.parametrize("argv, says", CASES, ids=[c[0].split(" --")[0] + ": " + c[1]
                                                   for c in CASES])
def test_one_line_and_exit_2(argv, says, capsys, tmp_path, down, not_redis, redis_server):
    redis_db99 = f"redis://127.0.0.1:{redis_server.port}/99"  # a database that does not exist
    words = (argv.replace("DOWN-DB99", redis_db99).replace("DOWN", down)
             .replace("NOTREDIS", not_redis).replace("OUT", str(tmp_path)).split(" "))
    if "a" in words and "b" in words:  # the run name with a space is one argument
        i = words.index("a")
        words[i:i + 2] = ["a b"]
    code = main(words)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("diloco: error:") and says in err[0], err


@pytest.mark.parametrize("command", ["status", "inspect"])
def test_refused_credentials_say_so(command, capsys, redis_server):
    """A wrong password (or a user that is off) is not "Redis did not answer"."""
    import redis

    redis.Redis(port=redis_server.port).acl_setuser("op", enabled=True, passwords=["+right"],
                                                    commands=["+@all"], keys=["*"])
    code = main([command, "--redis-url", f"redis://op:wrong@127.0.0.1:{redis_server.port}/0",
                 "--run", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "Redis refused the credentials" in err[0] and "did not answer" not in err[0], err
    assert "wrong" not in err[0]  # the password is never printed
