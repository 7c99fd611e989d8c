"""Joining the Ray cluster named by RAY_ADDRESS, or starting an embedded local Ray.

    acquire_ray(world_size, verbose)   # each RayExecutor, as it starts
    release_ray()                      # as it shuts down: the last one stops a Ray we started

Ray is one per process, so the executors alive in it share it: the first starts (or joins) it,
and it is stopped when the last of them is gone, never under another one's workers. A Ray the
caller initialised itself is left running.
"""
from __future__ import annotations

import logging
import os
import socket

import ray

from launch.deferred_signals import _deferred_signals


_users = 0  # RayExecutors alive in this process
_started = False  # whether this module started (or joined) the Ray they use


def acquire_ray(world_size: int, verbose: bool) -> None:
    global _users, _started
    if _ensure_ray(world_size, verbose):
        _started = True
    _users += 1


def release_ray() -> None:
    global _users, _started
    _users = max(_users - 1, 0)
    if _users == 0 and _started:
        _started = False
        if ray.is_initialized():
            ray.shutdown()


def _ensure_ray(world_size: int, verbose: bool) -> bool:
    """Join RAY_ADDRESS's cluster, or start an embedded local Ray; True when we started it.
    Not verbose (`--quiet`, the library's default): Ray's driver logs only errors, not its
    start-up lines (the local instance started, the token-authentication notice)."""
    if ray.is_initialized():
        return False
    level = logging.INFO if verbose else logging.ERROR
    address = os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
        ray.init(address=address, log_to_driver=False, logging_level=level)
        return True
    # address="local": always a fresh embedded instance, never an unrelated cluster that happens
    # to run on this machine (plain ray.init() would join it). A Ctrl-C in the middle of starting
    # the node would leave its agents running with no one to stop them: hold it until the node
    # is up, then shut the node down and deliver it.
    with _deferred_signals() as interrupted:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False,
                 log_to_driver=False, _node_ip_address="127.0.0.1", _system_config={"worker_niceness": 0},
                 logging_level=level)
    if interrupted:
        ray.shutdown()
        raise KeyboardInterrupt
    return True


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A host:port RAY_ADDRESS must accept a connection: ray.init retries an unreachable GCS
    forever. Other forms ("auto", ray://, http://) fail on their own."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({e.strerror or e})") from None
