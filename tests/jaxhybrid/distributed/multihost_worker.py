"""One process of a two-process multi-host job on local CPUs (test_tensor_parallel.py starts both): each has one
device, the engine runs tensor parallel over both. Process 0 generates and prints what `tp_worker.generate`
reports; process 1 follows and prints how many steps it ran. Still running after the seconds given, it prints
every thread's stack and exits: a hang in a collective shows where each process waits."""

import faulthandler
import json
import sys

from jaxhybrid.worker import multihost

if __name__ == "__main__":
    port, rank, deadline = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    faulthandler.dump_traceback_later(deadline, exit=True)
    multihost.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import jax

    from tests.jaxhybrid.distributed.tp_worker import generate, make_llm

    assert jax.device_count() == 2 and jax.local_device_count() == 1, jax.devices()
    llm = make_llm(jax.device_count())
    if multihost.is_leader():
        report = generate(llm)
        report["steps"] = llm.engine.stats.steps + llm.engine.on_device  # dispatched, read or not
        multihost.shutdown(llm)
    else:
        report = {"steps": multihost.follow(llm)}
    print(json.dumps(report))
