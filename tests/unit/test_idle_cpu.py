"""bench/idle_cpu.py's pure parts: which role and which kind of process each of a swarm's processes is,
and the table of a worker's CPU against the swarm's size."""

from agora.bench.idle_cpu import Process, Window, classify, scale_table


def test_each_process_is_named_by_its_role_and_kind():
    processes = {p.pid: p for p in [
        Process(10, 1, "python"),  # the launcher's server: a role of its own
        Process(20, 10, "worker-s0-r0"),  # the role's main process (launched: named by its role)
        Process(21, 20, "worker-s0-r0"),  # hivemind's DHT process: the parent of a p2pd
        Process(22, 21, "p2pd"),
        Process(23, 20, "worker-s0-r0"),  # the averager process
        Process(24, 20, "torch_shm_manag"),
        Process(30, 10, "bootstrap"),
        Process(31, 30, "bootstrap"),
        Process(32, 31, "p2pd"),
    ]}
    labels = classify(processes)
    assert labels[10] == ("python", "main")
    assert labels[20] == ("worker-s0-r0", "main")
    assert labels[21] == ("worker-s0-r0", "dht")
    assert labels[22] == ("worker-s0-r0", "p2pd")
    assert labels[23] == ("worker-s0-r0", "averager")
    assert labels[24] == ("worker-s0-r0", "other")
    assert labels[31] == ("bootstrap", "dht") and labels[32] == ("bootstrap", "p2pd")


def test_the_scale_table_puts_a_workers_mean_beside_log_n_and_n():
    def window(replicas: int, per_worker: float) -> Window:
        roles = {f"worker-s0-r{r}": {"main": per_worker / 2, "dht": per_worker / 4, "p2pd": per_worker / 4}
                 for r in range(replicas)}
        return Window("idle", f"1x{replicas}", 60.0, 1.0, 1.5, {**roles, "bootstrap": {"main": 9.0}})
    table = scale_table([window(2, 1.0), window(14, 3.0)], [4, 16])
    lines = table.splitlines()
    assert lines[-2].startswith("| 4 | 1x2 | 1.0 -> 1.5 | 0.50 | 0.25 | 0.25 | 1.00 | 1.00 | 1.00 | 1.00 |")
    assert lines[-1].startswith("| 16 | 1x14 | 1.0 -> 1.5 | 1.50 | 0.75 | 0.75 | 3.00 | 3.00 | 2.00 | 4.00 |")
