"""bench/idle_cpu.py's pure part: which role and which kind of process each of a swarm's processes is."""

from agora.bench.idle_cpu import Process, classify


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
