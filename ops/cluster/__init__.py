"""Running a job on this machine: an embedded redis-server, the supervisor of a run's
processes, the `diloco run` launcher (and its in-process twin), TCP proxies that cut links, and
the run's output folder."""

from ops.cluster import artifacts, tensorboard
from ops.cluster.inprocess import run_inprocess
from ops.cluster.launcher import Launcher, RunFailed, run_distributed
from ops.cluster.netproxy import TcpProxy
from ops.cluster.redis_server import ClusterServers, RedisServer, TlsFiles, free_port
from ops.cluster.secure import (
    SecureSetup,
    secure_init,
    write_bundles,
    write_keys,
    write_role_urls,
)
from ops.cluster.supervisor import (
    Supervisor,
    global_params,
    published_params,
    role_cmd,
    store_run_config,
)
from ops.cluster.wire import codec_sizes

__all__ = ["ClusterServers", "Launcher", "RedisServer", "RunFailed", "SecureSetup", "Supervisor",
           "TcpProxy", "TlsFiles", "artifacts", "codec_sizes", "free_port", "global_params",
           "published_params", "role_cmd", "run_distributed", "run_inprocess", "secure_init",
           "store_run_config", "tensorboard", "write_bundles", "write_keys", "write_role_urls"]
