"""Where ranks meet. A run without torchrun binds its store where the kernel says and leaves no MASTER_PORT behind:
stop 45's CI failed when an in-process run left one in a test worker's environment, still bound there, and the
next one-process launch from that worker inherited it (EADDRINUSE). A launcher's port is drawn where no other
connection can be handed it in the meantime."""

from __future__ import annotations

import os
import random

from qlora_fsdp.parallel.distributed import PORT_FLOOR, _ephemeral_floor, free_port, init_distributed, teardown


def test_a_launchers_port_is_below_the_ephemeral_range_and_not_drawn_from_the_seeded_generator() -> None:
    """Two test workers that seeded `random` alike (transformers' set_seed does) must not draw the same ports."""
    draws = []
    for _ in range(3):
        random.seed(0)
        draws.append((free_port(), free_port()))
    ports = [port for pair in draws for port in pair]
    assert all(PORT_FLOOR <= port < _ephemeral_floor() for port in ports), ports
    assert len(set(draws)) > 1, draws


def test_a_run_without_torchrun_joins_twice_and_sets_no_port(no_launcher: None) -> None:
    """The one-rank store listens on a port the kernel picks as it binds; none is left in the environment for a
    second group in the same process to reuse."""
    for _ in range(2):
        env = init_distributed(device="cpu")
        teardown()
        assert env.world_size == 1
        assert "MASTER_PORT" not in os.environ and "MASTER_ADDR" not in os.environ
