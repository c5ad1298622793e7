"""``launch_agent``: run one node's ftmem-launch agent (torch's ``launch_agent`` + the SMP).

torch's ``torch.distributed.launcher.api.launch_agent`` hard-codes ``LocalElasticAgent``;
this is the same sequence (rendezvous handler, ``WorkerSpec``, agent, result handling) with
:class:`~ftmem.launch.agent.FtmemElasticAgent`, the node's SMP, ftmem's safe defaults and the
exec shim around the ranks' command.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic import events
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.metrics import initialize_metrics
from torch.distributed.elastic.metrics.api import MetricsConfig
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.launcher.api import (
    LaunchConfig,
    _get_addr_and_port,
    _get_entrypoint_name,
)

import ftmem.launch.etcd_v3  # noqa: F401  (registers --rdzv-backend etcd-v3)
from ftmem.errors import UnrecoverableError
from ftmem.launch.agent import FtmemElasticAgent
from ftmem.launch.config import (
    FtmemLaunchConfig,
    apply_safe_env_defaults,
    apply_safe_rdzv_defaults,
    resolve_names,
    safe_name,
)
from ftmem.launch.elastic_compat import (
    check_torch_version,
    launch_shutdown_timeout,
)
from ftmem.launch.job_key import host_key_path, release_host_key
from ftmem.launch.membership import MembershipWatch
from ftmem.launch.smp_runner import SmpRunner
from ftmem.launch.state_guard import (
    guard_rendezvous_state,
    state_key,
)
from ftmem.launch.workers import wrap_entrypoint

log = logging.getLogger(__name__)


def launch_agent(
    config: LaunchConfig,
    ftmem: FtmemLaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[str],
) -> dict[int, Any]:
    """Run one node's ftmem-launch agent to completion (torch's ``launch_agent`` + the SMP).

    Returns each local rank's return value by global rank. Raises ``ChildFailedError``
    when the ranks failed beyond ``max_restarts`` or the no-progress guard stopped them,
    and ``SignalException`` when the agent was told to stop.

    Resource handling: the SMP is started before the first rendezvous (so its start-up
    overlaps the wait for other nodes) and is stopped on every exit path; ranks are spawned
    through the exec shim, so they die with the agent even if it is SIGKILLed.

    Raises:
        FtmemError: the running torch is older than ftmem-launch supports.
    """
    check_torch_version()
    if not config.run_id:
        config.run_id = uuid.uuid4().hex
        log.warning("no --rdzv-id given; generated run id %s", config.run_id)
    if ftmem.flush_dir is not None and ftmem.flush_persistent_dir is None and config.max_nodes > 1:
        log.warning(
            "multi-node run without --ftmem-flush-persistent-dir: each node keeps its own part "
            "of every flushed step (ftmem restores from them; stock DCP needs them assembled "
            "into one directory: `ftmem assemble`)"
        )
    entrypoint_name = _get_entrypoint_name(entrypoint, args)
    run_id = safe_name(config.run_id)
    resolve_names(ftmem, run_id)
    assert ftmem.node is not None and ftmem.run_dir is not None
    node, run_dir = ftmem.node, ftmem.run_dir
    env_set = apply_safe_env_defaults()
    if "last_call_timeout" in config.rdzv_configs:
        ftmem.restart_last_call = None  # the user's choice holds at restarts too
    rdzv_set = apply_safe_rdzv_defaults(config.rdzv_configs)
    log.info(
        "[%s] ftmem-launch: run id %s, run dir %s, nodes %s:%s x %d ranks, max restarts %d, "
        "hang timeout %s s, safe defaults applied: %s",
        node,
        run_id,
        run_dir,
        config.min_nodes,
        config.max_nodes,
        config.nproc_per_node,
        config.max_restarts,
        ftmem.hang_timeout.total_seconds() or "off",
        {**env_set, **rdzv_set} or "none (all set by the user)",
    )
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    wrapped, wrapped_args = wrap_entrypoint(entrypoint, args)
    # Options newer torch versions added to WorkerSpec are passed only where they exist.
    spec_fields = {f.name for f in dataclasses.fields(WorkerSpec)}
    optional = {
        name: getattr(config, name)
        for name in (
            "numa_options",
            "duplicate_stdout_filters",
            "duplicate_stderr_filters",
            "virtual_local_rank",
        )
        if name in spec_fields and getattr(config, name, None) is not None
    }
    # elastic unpickles the rendezvous state it reads: checked first (and MACed with a key).
    rdzv_handler = rdzv_registry.get_rendezvous_handler(rdzv_parameters)
    guard_rendezvous_state(rdzv_handler, state_key(ftmem.key_file))
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=wrapped,
        args=tuple(wrapped_args),
        rdzv_handler=MembershipWatch(rdzv_handler, node),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        **optional,
    )
    smp = SmpRunner(
        run_dir=run_dir,
        run_id=run_id,
        node=node,
        slots=ftmem.slots,
        start_timeout=ftmem.smp_start_timeout,
        # A final flush on SIGTERM needs time before the SMP is SIGKILLed.
        stop_timeout=(
            max(ftmem.smp_stop_timeout, ftmem.flush_on_stop + timedelta(seconds=10))
            if ftmem.flush_tiers()
            else ftmem.smp_stop_timeout
        ),
        log_level=ftmem.smp_log_level,
        extra_env=ftmem.extra_env,
        settings=ftmem.smp_settings(),
    )
    agent = FtmemElasticAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=launch_shutdown_timeout(config),
        ftmem=ftmem,
        smp=smp,
    )
    # Only a job that is over (finished, failed past its restarts or the no-progress guard, or
    # beyond repair) closes the rendezvous for every node; an agent that fails for its own
    # reasons (store unreachable, partition, signal) leaves it open for the others.
    shutdown_rdzv = False
    succeeded = False
    try:
        initialize_metrics(MetricsConfig(config.metrics_cfg))
        if agent.metrics is not None:
            agent.metrics.start()
        smp.start()
        result: RunResult | None = agent.run()
        # records that agent.run() succeeded, not that the ranks did (as torch does)
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        shutdown_rdzv = True
        if result is None:  # the rendezvous was closed gracefully
            succeeded = True
            return {}
        if result.is_failed():
            agent.report_last_failure()
            raise ChildFailedError(name=entrypoint_name, failures=result.failures)
        succeeded = True
        values: dict[int, Any] = result.return_values
        return values
    except ChildFailedError:
        raise
    except UnrecoverableError:
        shutdown_rdzv = True  # every node reaches the same verdict
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception as exc:
        log.error(
            "[%s] ftmem-launch stops (%s); the rendezvous stays open for the other nodes",
            node,
            "signalled" if isinstance(exc, SignalException) else f"{type(exc).__name__}",
        )
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if agent.metrics is not None:
            agent.metrics.stop()
        smp.stop()
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        # The key the job's agents share on this host goes when the job is over or with its
        # last agent here (a late agent of the same job makes a new one).
        release_host_key(host_key_path(smp.run_id), job_over=shutdown_rdzv)
        if ftmem.auto_run_dir and succeeded:  # a run dir of the user's is never removed
            shutil.rmtree(run_dir, ignore_errors=True)
        elif ftmem.auto_run_dir:
            log.info("run dir kept for inspection: %s", run_dir)
