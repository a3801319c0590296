"""``sdp.metrics.collectives.count_collectives`` records a collective issued on another thread while this
thread is inside an intercepted call: a DDP comm hook's futures run their callbacks (PowerSGD's P and Q
all-reduces) on the backend's threads while backward goes on, so a nesting depth shared by all threads
dropped those records. No process group: ``torch.distributed``'s functions are stand-ins here."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from sdp.metrics.collectives import count_collectives
from sdp.metrics.comm import CommCounter


def test_a_collective_on_another_thread_during_an_intercepted_call_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    other = torch.zeros(5)

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
        return None

    def fake_broadcast(tensor, src=None, group=None, async_op=False, group_src=None):  # type: ignore[no-untyped-def]
        # this thread is inside the intercepted broadcast; another thread issues an all-reduce meanwhile
        t = threading.Thread(target=dist.all_reduce, args=(other,))
        t.start()
        t.join()

    for module in (dist, c10d):
        monkeypatch.setattr(module, "all_reduce", fake_all_reduce)
        monkeypatch.setattr(module, "broadcast", fake_broadcast)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    comm = CommCounter(measuring=True)
    with count_collectives(comm):
        dist.broadcast(torch.zeros(3), src=0)
    comm.end_step()
    recorded = sorted(tuple(r) for r in comm.state_dict()["steps"][0])
    assert recorded == [("all_reduce", 20, 2), ("broadcast", 12, 2)], f"recorded {recorded}: the other thread's all-reduce was dropped"
