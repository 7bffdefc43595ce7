"""Learner islands: one learner's inner training spread over several local JAX devices.

A `Placement` is where one learner (an *island*) trains: a 1-D `jax.sharding.Mesh` with the
axis ``"data"`` over some of this process's devices. Everything the learner holds on the
devices goes through it: the parameters (`Placement.params`, also whenever merged values from
the network replace some entries — entries already placed are passed through untouched), the
optimiser state (`Placement.opt_state`), each batch (`Placement.batch`), and the jitted step
(`Placement.step`, the same signature and results as `pipeline.train.make_step`'s, compiled for
these shardings, so its outputs stay where its inputs were and nothing moves between steps).
`Placement.host` gathers any of them back as numpy copies (what the wire and the checkpoints
take).

Two layouts, the same math (the island computes the step of one device on the whole global
batch, up to the order of floating-point sums):

* **data parallel** (the default): the batch ``[batch, seq_len + 1]`` is split over ``"data"``
  along its first axis (so ``inner.batch_size`` must divide by the number of devices);
  parameters and optimiser state are replicated on every device. XLA all-reduces the
  gradients; every device applies the same update.
* **FSDP** (``fsdp=True``): the batch is split the same way, and each parameter and its
  optimiser moments are split over ``"data"`` along one axis — the largest axis whose length
  divides by the number of devices (the first such on a tie); an array with no such axis, and
  every scalar (the step counts), stays replicated. Each device keeps only its slice of the
  parameters and of the AdamW moments between steps; XLA's partitioner inserts the
  collectives (gathering parameters for the passes, reducing the gradients to the slices).

A placement of one device is plain single-device training: the same numbers, bit for bit, as
`pipeline.train.make_step` without any placement.

Nothing here assumes a platform: the devices are ``jax.local_devices()`` (GPUs, TPU cores, or
CPU devices) or the ones given. To try several devices on a machine with one CPU, have XLA
split the host into N devices before JAX initialises its backends — in a shell::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python ...

or, in a program, `force_host_devices` (before the first JAX operation). The tests
(tests/test_mesh.py) run their multi-device checks in a subprocess started that way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipeline import fused
from pipeline.task import Task
from pipeline.train import make_step

AXIS = "data"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

__all__ = ["AXIS", "Placement", "force_host_devices"]


def force_host_devices(n: int, environ: MutableMapping[str, str] | None = None) -> None:
    """Split the host CPU into `n` JAX devices (the CPU platform only; GPUs and TPUs are not
    affected). For command-line tools that run islands on a CPU-only machine.

    It must run before JAX initialises its backends (the first JAX operation, or the first
    ``jax.devices()``): XLA reads the device count once, when it creates the CPU client, and
    never again in that process. Importing jax (or this module) does not initialise anything.
    Raises RuntimeError when the backends are already up with another number of CPU devices.

    If `environ` is given (a command-line tool passes its process environment; nothing in
    pipeline/ reads or writes it on its own), ``XLA_FLAGS`` in it gets
    ``--xla_force_host_platform_device_count=n`` too (replacing an earlier count), so the
    processes it starts split their CPU the same way.
    """
    if n < 1:
        raise ValueError(f"force_host_devices: n must be at least 1, not {n}")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != n:
            raise RuntimeError(
                f"force_host_devices({n}): JAX has already initialised its backends with "
                f"{have} CPU device(s); XLA reads the device count only once, when the first "
                f"JAX operation runs. Call it earlier (before any JAX computation or "
                f"jax.devices()), or start the process with "
                f"XLA_FLAGS={_DEVICE_COUNT_FLAG}={n}.") from None
    if environ is not None:
        rest = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S*", "", environ.get("XLA_FLAGS", "")).split()
        environ["XLA_FLAGS"] = " ".join([*rest, f"{_DEVICE_COUNT_FLAG}={n}"])


def _placed(x: jax.Array, target: NamedSharding) -> bool:
    """Whether `x` already lies as `target` says (the same sharding, or an equivalent one:
    a single-device array on the device of a one-device mesh)."""
    return x.sharding == target or x.sharding.is_equivalent_to(target, x.ndim)


class Placement:
    """Where one learner's training runs: a 1-D mesh (axis ``"data"``) over local devices.

    `devices`: how many of ``jax.local_devices()`` to use (the first N), None for all of them,
    or the devices themselves. `fsdp`: shard parameters and optimiser state over the devices
    instead of replicating them (see the module docstring).
    """

    def __init__(self, devices: int | Sequence[jax.Device] | None = None, fsdp: bool = False):
        local = jax.local_devices()
        if devices is None:
            devs = list(local)
        elif isinstance(devices, int | np.integer):
            if not 1 <= devices <= len(local):
                raise ValueError(f"Placement: {devices} devices asked for, this process has "
                                 f"{len(local)} ({local[0].platform})")
            devs = list(local[:devices])
        else:
            devs = list(devices)
            if not devs:
                raise ValueError("Placement: an empty list of devices")
            if len(set(devs)) != len(devs):
                raise ValueError(f"Placement: a device is named twice in {devs}")
            mine = set(jax.local_devices(backend=devs[0].platform))
            if not all(d in mine for d in devs):
                raise ValueError(f"Placement: {devs} are not all devices of this process")
        self.devices: tuple[jax.Device, ...] = tuple(devs)
        self.fsdp = bool(fsdp)
        self.mesh = Mesh(np.array(devs, dtype=object), (AXIS,))
        self._replicated = NamedSharding(self.mesh, P())
        self._split_batch = NamedSharding(self.mesh, P(AXIS))

    def __repr__(self) -> str:
        kind = "fsdp" if self.fsdp else "dp"
        return f"Placement({self.n_devices} x {self.devices[0].platform}, {kind})"

    @property
    def n_devices(self) -> int:
        """Number of devices of the island."""
        return len(self.devices)

    # --- shardings ------------------------------------------------------------------------

    def array_sharding(self, shape: Sequence[int]) -> NamedSharding:
        """The sharding of a parameter (or an optimiser-state leaf) of this shape: replicated,
        or under FSDP split over ``"data"`` along its largest axis that divides evenly."""
        n = self.n_devices
        if not self.fsdp or n == 1:
            return self._replicated
        fits = [(size, -i) for i, size in enumerate(shape) if size % n == 0]
        if not fits:
            return self._replicated
        axis = -max(fits)[1]
        return NamedSharding(self.mesh, P(*([None] * axis), AXIS))

    @property
    def batch_sharding(self) -> NamedSharding:
        """A batch's sharding: split over ``"data"`` along its first (batch) axis."""
        return self._split_batch

    def _shardings(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: self.array_sharding(np.shape(x)), tree)

    # --- placing ----------------------------------------------------------------------------

    def _put(self, tree: Any) -> Any:
        """Each leaf on its sharding; leaves already there are returned as they are, the rest
        go in one transfer."""
        leaves, treedef = jax.tree.flatten(tree)
        moves = []
        for i, x in enumerate(leaves):
            target = self.array_sharding(np.shape(x))
            if not (isinstance(x, jax.Array) and _placed(x, target)):
                moves.append((i, target))
        if moves:
            placed = jax.device_put([leaves[i] for i, _ in moves], [s for _, s in moves])
            for (i, _), x in zip(moves, placed, strict=True):
                leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def params(self, tree: Any) -> Any:
        """The parameters (numpy or jax arrays, any mix) placed on the island. Cheap for
        entries already placed: only the others are transferred."""
        return self._put(tree)

    def opt_state(self, state: Any) -> Any:
        """An optimiser state placed like the parameters (its moments have their shapes; its
        scalars, such as the step counts, are replicated)."""
        return self._put(state)

    def batch(self, x: Any) -> Any:
        """A batch split over the devices along the first axis of each array: a
        ``[batch, ...]`` array, or a pytree of them for a task whose batches are trees.
        Arrays already split that way are passed through."""
        leaves, treedef = jax.tree.flatten(x)
        for leaf in leaves:
            shape = np.shape(leaf)
            if not shape or shape[0] % self.n_devices:
                size = shape[0] if shape else "a scalar"
                raise ValueError(f"inner.batch_size {size} does not divide by the island's "
                                 f"{self.n_devices} devices; use a multiple of "
                                 f"{self.n_devices}")
        moves = [i for i, leaf in enumerate(leaves)
                 if not (isinstance(leaf, jax.Array) and _placed(leaf, self._split_batch))]
        if moves:
            placed = jax.device_put([leaves[i] for i in moves], self._split_batch)
            for i, leaf in zip(moves, placed, strict=True):
                leaves[i] = leaf
        return jax.tree.unflatten(treedef, leaves)

    def host(self, tree: Any) -> Any:
        """Numpy copies of the leaves of `tree`, gathered from the devices."""
        return jax.tree.map(np.array, jax.device_get(tree))

    # --- the step ---------------------------------------------------------------------------

    def step(self, task: Task, opt: optax.GradientTransformation) -> Callable:
        """A jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` as
        `pipeline.train.make_step`'s, compiled for this placement: it takes the parameters and
        state as `params`/`opt_state` placed them (numpy or single-device arrays are placed on
        the way in) and a batch as `batch` placed it, and returns the parameters and state
        placed the same way and replicated scalar metrics."""
        shapes = {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in task.param_shapes().items()}
        param_sh = self._shardings(shapes)
        state_sh = self._shardings(jax.eval_shape(opt.init, shapes))
        # train.make_step's own step (a jitted function inlines into this one): the same
        # computation, now with its inputs and outputs pinned to the island (a batch that is a
        # tree is split leaf by leaf; every metric is replicated)
        step = make_step(task, opt)
        if self.n_devices > 1:
            # XLA's partitioner cannot split the fused kernels' foreign calls (it would gather
            # the batch onto every device): trace the JAX definitions instead
            inner = step

            def step(params, opt_state, batch):
                with fused.unfused():
                    return inner(params, opt_state, batch)

        return jax.jit(step, in_shardings=(param_sh, state_sh, self._split_batch),
                       out_shardings=(param_sh, state_sh, self._replicated))
