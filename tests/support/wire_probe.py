import time
from tests.support.jobs import _parallelize
from tests.support.wire import guard_program, wire_problems

def probe_job(model, plan, local=False, **options):
    pm, batches = _parallelize(model, plan, "sgd", {}, **options)
    def step(b):
        if local:
            inputs, target = b
            slc = pm.batch_slice(target.shape[0], target.shape[1])
            return pm.train_step(tuple(slc.take(t) for t in inputs), slc.take(target), local=True)
        return pm.train_step(*b)
    t0 = time.perf_counter(); step(batches[0]); t1 = time.perf_counter()
    step(batches[1]); t2 = time.perf_counter()
    guard_program(pm)
    step(batches[2]); t3 = time.perf_counter()
    comm = pm.comm_stats()
    return {"times": [round(t1-t0,3), round(t2-t1,3), round(t3-t2,3)], "wire": comm.wire, "problems": wire_problems(comm, comm.wire)}
