"""Lockstep capture: the ranks of a process group capture the same graphs, in the same order.

A model with collectives inside (tensor parallelism's all-reduces, data parallelism's expert
exchanges) runs them during every warm-up and capture. So the ranks must capture the same keys
in the same order, or a rank waits forever in a collective another rank never starts; and one
rank's failure must reach the others, or they wait forever in the next one. This module is the
protocol that makes :meth:`GraphRunner.capture` safe there (``GraphRunner(..., lockstep=True)``):

    agree     every rank posts its plan (the config fields that decide the graphs, every
              input's kind, dtype and shape, and the graphs in order) and compares every plan
              with rank 0's: a difference is a ConfigError on every rank, naming the field (or
              the input), both values and the ranks, before anything is captured;
    graph i   a barrier, the capture, a barrier at which each rank says whether it succeeded;
    failure   a rank that fails posts what failed (its rank, the graph, the error); every rank
              raises a CaptureError naming it once every rank has reported or ``timeout_s``
              passed, never later.

The protocol runs over the group's store (``torch.distributed.Store``), never over the group's
collectives (a store that cannot be reached any more, its host rank gone, is a CaptureError
naming it, never a raw ``DistNetworkError``): a status exchange can then never pair with a model
collective one rank is still waiting in. That wait is bounded too: for the session, the
collectives of the lockstep group (and of ``Lockstep.collective_groups``) time out after
``timeout_s`` instead of the group's own timeout (30 minutes by default), so a rank waiting for
a rank that failed gives up, reports and raises. Such a group may hold a collective one rank
never joined afterwards: the error says to re-create it (or restart the ranks) before capturing
again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from freezeframe.batch import GraphKey
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.errors import CaptureError, ConfigError
from freezeframe.runtime.dist import group_store, group_timeout, rank_and_size, set_group_timeout

__all__ = ["Lockstep", "LockstepCapture", "capture_plan", "in_lockstep", "key_name",
           "lockstep_session", "plan_difference"]

logger = logging.getLogger(__name__)

# the first pause between two looks at the store, and the longest (it doubles)
_POLL_S, _MAX_POLL_S = 0.0005, 0.05


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """Capture in lockstep with the other ranks of ``group`` (default: the world).

    ``timeout_s`` bounds every wait of the protocol and, during the capture, every collective
    of ``group`` and of ``collective_groups`` (the groups the model's collectives run on, when
    they are not ``group``): warm-ups that compile for longer than that on one rank need a
    larger one.
    """

    group: Any = None
    timeout_s: float = 120.0
    collective_groups: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) \
                or t <= 0:
            raise ConfigError(f"Lockstep.timeout_s must be a number of seconds > 0, got {t!r}")
        if not isinstance(self.collective_groups, tuple):
            raise ConfigError(
                f"Lockstep.collective_groups must be a tuple of process groups, got "
                f"{self.collective_groups!r}; pass (group,) for one")


def key_name(key: GraphKey) -> str:
    """A graph key in a few words: ``FULL tokens=8 reqs=4 uniform``."""
    mode, desc = key
    words = [mode.name, f"tokens={desc.num_tokens}"]
    if desc.num_reqs is not None:
        words.append(f"reqs={desc.num_reqs}")
    if desc.uniform:
        words.append("uniform")
    if desc.has_lora:
        words.append(f"loras={desc.num_active_loras}")
    return " ".join(words)


def capture_plan(config: CompilationConfig, order: Sequence[GraphKey],
                 budget: int | None, inputs: Sequence[tuple[str, str, Any]] = ()
                 ) -> dict[str, Any]:
    """What the ranks must agree on before capture: the config fields that decide which
    graphs are captured and how, each input (its name, kind, dtype and static shape: ``inputs``
    are the runner's static buffers, (name, kind, tensor)), and the graphs in capture order
    (JSON values)."""
    mode = config.cudagraph_mode  # resolved: a CUDAGraphMode
    return {
        "inputs": [f"{name}: {kind} {_tensor_words(buf)}" for name, kind, buf in inputs],
        "cudagraph_mode": mode.name if isinstance(mode, CUDAGraphMode) else str(mode),
        "cudagraph_capture_sizes": list(config.cudagraph_capture_sizes or ()),
        "max_num_tokens": config.max_num_tokens,
        "max_num_seqs": config.max_num_seqs,
        "cudagraph_num_of_warmups": config.cudagraph_num_of_warmups,
        "graph_backend": config.graph_backend,
        "micro_batching": config.micro_batching,
        "graph_memory_budget": budget,
        "graphs": [key_name(key) for key in order],
    }


def _tensor_words(buf: Any) -> str:
    if not isinstance(buf, torch.Tensor):
        return type(buf).__name__
    return f"{str(buf.dtype).removeprefix('torch.')} {list(buf.shape)}"


def plan_difference(plans: Sequence[dict[str, Any]]) -> str | None:
    """How the first plan that differs from rank 0's differs (None when all agree): the
    field, both values and both ranks, and for the graph order the first graph that differs."""
    base = plans[0]
    for rank, plan in enumerate(plans[1:], start=1):
        for field in dict.fromkeys([*base, *plan]):
            mine, theirs = plan.get(field), base.get(field)
            if mine == theirs:
                continue
            if field in ("graphs", "inputs") and isinstance(mine, list) \
                    and isinstance(theirs, list):
                index = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
                              if a != b), min(len(mine), len(theirs)))
                noun = "graph" if field == "graphs" else "input"
                what = (f"{noun} {index} is {_at(mine, index)} on rank {rank} but "
                        f"{_at(theirs, index)} on rank 0 ({len(mine)} vs {len(theirs)} "
                        f"{field})")
            else:
                what = f"rank {rank} has {field}={mine!r} but rank 0 has {field}={theirs!r}"
            return (f"lockstep capture: the ranks disagree before capture: {what}. Every rank "
                    f"must capture the same graphs in the same order: give every rank the same "
                    f"{field} (the same CompilationConfig and runner options)")
    return None


def _at(graphs: list[Any], index: int) -> str:
    return str(graphs[index]) if index < len(graphs) else "missing"


@dataclasses.dataclass(frozen=True)
class _Failure:
    """What one rank posted when it failed: where (a graph, or None before the first) and
    why."""

    rank: int
    graph: int | None
    key: str
    error: str

    def describe(self, num_graphs: int) -> str:
        where = (f"at graph {self.graph + 1} of {num_graphs} ({self.key})"
                 if self.graph is not None else f"({self.key})")
        return f"rank {self.rank} failed {where}: {self.error}"


class LockstepCapture:
    """One :meth:`GraphRunner.capture` across the ranks (see the module docstring).

    Open it with :meth:`open` (which agrees on the plan), run each graph inside
    :meth:`graph`, report a failure outside every graph with :meth:`failed`, and
    :meth:`close` it (which gives the groups their own collective timeout back).
    """

    def __init__(self, lockstep: Lockstep, rank: int, size: int, store: Any,
                 num_graphs: int) -> None:
        self.lockstep, self.rank, self.size = lockstep, rank, size
        self.num_graphs = num_graphs
        self._store = store
        self._restore: list[tuple[Any, datetime.timedelta]] = []
        self._reported = False  # this rank posted its failure

    @classmethod
    def open(cls, lockstep: Lockstep, plan: dict[str, Any]) -> LockstepCapture | None:
        """Agree on ``plan`` with the other ranks; None when the group has one rank."""
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "GraphRunner(lockstep=...): torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) before capture(), or leave "
                "lockstep off for a single process")
        rank, size = rank_and_size(lockstep.group)
        if size == 1:
            return None
        base = _Reachable(group_store(lockstep.group), rank)
        # each rank's n-th capture() on this group is session n: a namespace of its own
        session = base.add(f"freezeframe/lockstep/sessions/{rank}", 1)
        store = _Reachable(dist.PrefixStore(f"freezeframe/lockstep/{session}/", base.store),
                           rank)
        sync = cls(lockstep, rank, size, store, len(plan.get("graphs", ())))
        sync._bound_collectives()
        try:
            sync._agree(plan)
        except BaseException:
            sync.close()
            raise
        return sync

    def close(self) -> None:
        for group, timeout in self._restore:
            set_group_timeout(group, timeout)
        self._restore = []

    # -- the protocol ------------------------------------------------------------------------
    def _agree(self, plan: dict[str, Any]) -> None:
        self._store.set(f"plan/{self.rank}", json.dumps(plan))
        self._wait_all("plan", "capture() (where the ranks compare their plans)")
        plans = [json.loads(self._store.get(f"plan/{r}")) for r in range(self.size)]
        # every rank has read every plan before any rank raises (rank 0 may host the store)
        self._store.set(f"read/{self.rank}", "")
        self._wait_all("read", "the comparison of the plans")
        difference = plan_difference(plans)
        if difference is not None:
            raise ConfigError(difference)

    @contextlib.contextmanager
    def graph(self, index: int, key: str) -> Iterator[None]:
        """Around the capture of graph ``index`` (``key`` names it): a barrier before, and
        after it every rank's outcome; any rank's failure raises here on every rank."""
        self._wait_all(f"g{index}/start", f"graph {index + 1} of {self.num_graphs} ({key})",
                       graph=(index, key))
        try:
            yield
        except Exception as exc:
            try:
                self._post(index, key, exc)
                self._store.set(f"g{index}/done/{self.rank}", "failed")
                # a rank waiting for this one in a collective gives up timeout_s after it
                # began waiting, which may be after this failure: twice the timeout hears it
                self._wait_all(f"g{index}/done", "", graph=(index, key), quiet=True,
                               patience=2.0)
                error = self._failure_error()
            except CaptureError as lost:  # the store is gone: say so, and this rank's failure
                raise CaptureError(
                    f"{lost} This rank ({self.rank}) failed at graph {index + 1} of "
                    f"{self.num_graphs} ({key}): {type(exc).__name__}: {exc}") from exc
            raise error from exc
        except BaseException as exc:  # KeyboardInterrupt and the like: tell the others, go
            self._post(index, key, exc)
            raise
        self._store.set(f"g{index}/done/{self.rank}", "ok")
        self._wait_all(f"g{index}/done", f"the end of graph {index + 1} of {self.num_graphs} "
                       f"({key})", graph=(index, key))
        if self._failure_count():
            raise self._failure_error()

    def failed(self, exc: BaseException, where: str) -> None:
        """A failure outside every graph (``where``): the others stop at their next barrier."""
        if not self._reported:
            self._post(None, where, exc)

    def _post(self, index: int | None, key: str, exc: BaseException) -> None:
        if self._reported:
            return
        self._reported = True
        failure = {"rank": self.rank, "graph": index, "key": key,
                   "error": f"{type(exc).__name__}: {exc}"}
        number = self._store.add("failures", 1)
        self._store.set(f"failure/{number}", json.dumps(failure))

    def _failure_count(self) -> int:
        return int(self._store.add("failures", 0))

    def _failures(self) -> list[_Failure]:
        count = self._failure_count()
        return [_Failure(**json.loads(self._store.get(f"failure/{n}")))
                for n in range(1, count + 1)]

    def _failure_error(self) -> CaptureError:
        """The error every rank raises for the failures posted, after every rank has read
        them (or the timeout passed): the first is the cause, the later ones its echo."""
        failures = self._failures()
        self._store.set(f"ack/{self.rank}", "")
        with contextlib.suppress(CaptureError):
            self._wait_all("ack", "", quiet=True)
        described = "; then ".join(f.describe(self.num_graphs) for f in failures)
        return CaptureError(
            f"lockstep capture stopped on every rank: {described}. This rank "
            f"({self.rank}) freed the graphs of this capture. A rank that was waiting in a "
            "collective the failed rank never joined gave up after Lockstep.timeout_s, so the "
            "process groups may be out of step: re-create them (or restart the ranks) before "
            "capturing again")

    def _wait_all(self, name: str, stage: str, graph: tuple[int, str] | None = None,
                  quiet: bool = False, patience: float = 1.0) -> None:
        """Post ``name/<rank>`` (unless posted) and wait for every rank's: stop early at
        another rank's failure (unless ``quiet``: the failure path waits for the reports),
        raise a CaptureError naming the missing ranks after ``patience`` timeouts (quiet:
        return)."""
        keys = [f"{name}/{r}" for r in range(self.size)]
        if not self._store.check([keys[self.rank]]):
            self._store.set(keys[self.rank], "")
        try:
            self._wait_for(keys, stage, graph, quiet, patience)
        except _StoreLost as lost:
            if not stage:
                raise
            raise CaptureError(f"{lost} This rank ({self.rank}) was waiting for {stage}.") \
                from lost

    def _wait_for(self, keys: list[str], stage: str, graph: tuple[int, str] | None,
                  quiet: bool, patience: float) -> None:
        deadline = time.monotonic() + patience * self.lockstep.timeout_s
        pause = _POLL_S
        while not self._store.check(keys):
            if not quiet and self._failure_count():
                raise self._failure_error()
            if time.monotonic() > deadline:
                if quiet:
                    return
                missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
                error = CaptureError(
                    f"lockstep capture: rank(s) {missing} did not reach {stage} within "
                    f"Lockstep.timeout_s={self.lockstep.timeout_s} s (this is rank "
                    f"{self.rank}). Every rank of the group must call capture() as many times, "
                    "with the same config; a rank still compiling needs a larger timeout_s")
                index, key = graph if graph is not None else (None, stage)
                self._post(index, key, error)
                raise error
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_S)

    def _bound_collectives(self) -> None:
        """The lockstep group's collectives (and ``collective_groups``') give up after
        ``timeout_s`` for the session; :meth:`close` restores their own timeout."""
        dist = torch.distributed
        groups = [self.lockstep.group if self.lockstep.group is not None else dist.group.WORLD,
                  *self.lockstep.collective_groups]
        bound = datetime.timedelta(seconds=self.lockstep.timeout_s)
        for group in dict.fromkeys(groups):
            old = group_timeout(group)
            if old is not None and set_group_timeout(group, bound):
                self._restore.append((group, old))


@contextlib.contextmanager
def lockstep_session(lockstep: Lockstep | None, config: CompilationConfig,
                     order: Sequence[GraphKey], budget: int | None,
                     inputs: Sequence[tuple[str, str, Any]] = ()
                     ) -> Iterator[LockstepCapture | None]:
    """Around a capture's loop over ``order``: with ``lockstep``, the plan agreed first (a
    ConfigError on every rank when the ranks differ), a failure between graphs (a graph-memory
    budget refused) posted for the other ranks' next barrier, and the groups' own collective
    timeouts back at the end. ``inputs``: the runner's static buffers (name, kind, tensor),
    whose dtypes and shapes are part of the plan. Without it (or with one rank), it yields
    None."""
    sync = LockstepCapture.open(lockstep, capture_plan(config, order, budget, inputs)) \
        if lockstep is not None else None
    if sync is None:
        yield None
        return
    try:
        yield sync
    except BaseException as exc:
        sync.failed(exc, "between graphs")
        raise
    finally:
        sync.close()


class _StoreLost(CaptureError):
    """The protocol's store cannot be reached any more (its host rank stopped)."""


class _Reachable:
    """The store of the protocol, whose every operation raises a CaptureError (never torch's
    raw ``DistNetworkError: Broken pipe``) once the store cannot be reached: its host rank
    (rank 0 for a default group) has stopped."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self._rank = store, rank

    def _call(self, what: str, *args: Any) -> Any:
        try:
            return getattr(self.store, what)(*args)
        except Exception as exc:
            if not _unreachable(exc):
                raise
            raise _StoreLost(
                f"lockstep capture: the process group's store cannot be reached from rank "
                f"{self._rank} ({type(exc).__name__}: {exc}): the rank hosting it (rank 0 of "
                "a default group) has stopped, so no rank can report to the others. Restart "
                "the ranks (and the process group) before capturing again.") from exc

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> Any:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store cannot be reached (torch's DistError family, a broken
    connection), as opposed to a bug."""
    dist_error = getattr(torch.distributed, "DistError", None)
    return (dist_error is not None and isinstance(exc, dist_error)) or isinstance(
        exc, (ConnectionError, TimeoutError))


def in_lockstep(sync: LockstepCapture | None, index: int,
                key: GraphKey) -> contextlib.AbstractContextManager[None]:
    """Around the capture of ``key``, graph ``index`` of the order: between the two barriers
    of :meth:`LockstepCapture.graph` in lockstep, nothing otherwise."""
    return sync.graph(index, key_name(key)) if sync is not None else contextlib.nullcontext()
