"""The exit handler of autopar.runtime.exit_drain joins the gloo workers of groups nobody holds.

A rank of examples/train_llama.py aborted at exit about one run in ten ("terminate called
without an active exception"): a gloo worker freed a finished collective's tensors after the
interpreter had begun finalizing.  The handler runs before finalization; what it must do is
leave no gloo worker thread running when the groups are unreachable (the example's case: the
ParallelModule in a reference cycle), which these tests check in a fresh process.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import gc, os, socket, torch, torch.distributed as dist
    from autopar.runtime import exit_drain

    def workers():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        return names.count("pt_gloo_runloop")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group([0])
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, torch.ones(4), group=group)
    holder = {"group": group}
    holder["self"] = holder          # a cycle, as a ParallelModule's is: only gc frees it
    del group
    dist.destroy_process_group()
    del holder
    before = workers()
    gc.disable()                     # nothing frees the cycle but the handler
    exit_drain._drain()
    print(before, workers())
""")


def test_the_exit_handler_joins_the_workers_of_unreachable_groups():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert before > 0, "the setup should leave gloo workers running until the cycle is collected"
    assert after == 0


def test_the_handler_is_registered_once_per_process(monkeypatch):
    from autopar.runtime import exit_drain

    registered = []
    monkeypatch.setattr(exit_drain, "_REGISTERED", False)
    monkeypatch.setattr(exit_drain.atexit, "register", registered.append)
    exit_drain.drain_at_exit()
    exit_drain.drain_at_exit()
    assert registered == [exit_drain._drain]
