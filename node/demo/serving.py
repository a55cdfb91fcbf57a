"""`agora-node demo --serve --checkpoint C`: a serving swarm on loopback, up until Ctrl-C.

Order, each step a real `agora-node <role>` process with a ready file as its handshake: (unless
--insecure) the run's authorizer and an operator-credentialed bootstrap, else a bare bootstrap;
`--replicas` serve-only workers per stage (`join --serve-only --checkpoint C`, split into
`--stages`); then `serve`, the OpenAI-compatible API, admitted as a client. The demo prints the
API's URL and the `generate` command that reaches the same swarm, and keeps everything up until
Ctrl-C (or SIGTERM), then stops the processes newest first and exits 0. A worker that dies is
reported and the others keep serving (the client moves sessions to a live replica).
"""

from __future__ import annotations

import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from agora.node.demo.demo import (DemoOptions, _interrupt_on, _operator_issued, _start_authorizer, _start_bootstrap,
                                  _state_dir)
from agora.node.demo.processes import ChildFailed, ProcessGroup, agora_node_command
from agora.pipeline.config import load_config

__all__ = ["run_serving_demo"]


def run_serving_demo(options: DemoOptions, *, out=sys.stdout) -> int:
    workdir = (Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="agora-serve-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(workdir)
    previous = _interrupt_on(signal.SIGINT, signal.SIGTERM)
    code = 0
    try:
        common = ["--log-level", "WARNING", "--threads", str(options.threads)]
        maddrs = _start_bootstrap(group, options, workdir, common)
        swarm = ["--run-id", options.run_id, "--initial-peers", *maddrs]
        admission = ["--insecure"]
        if not options.insecure:
            _start_authorizer(group, options, workdir, maddrs, common, [])
            admission = ["--join-file", str(workdir / "authorizer" / "join.json")]
        workers = []
        for stage in range(options.stages or 1):
            for replica in range(options.replicas):
                name = f"worker-s{stage}-r{replica}"
                ready = workdir / f"{name}.ready"
                command = agora_node_command(
                    "--log-level", "INFO", "--threads", str(options.threads), "join", "--serve-only",
                    "--checkpoint", str(options.checkpoint), "--stage", str(stage), *options.run_flags(), *swarm,
                    *admission, *_state_dir(options, workdir, name), "--heartbeat", str(options.heartbeat_s),
                    "--ready-file", str(ready))
                workers.append(group.spawn(name, command, ready))
        group.wait_ready(workers, options.ready_timeout_s)
        serve_ready = workdir / "serve.ready"
        serve = group.spawn("serve", agora_node_command(
            *common, "serve", *options.run_flags(), *swarm,
            *_operator_issued(options, workdir, "serve", "client", admission),
            "--port", str(options.http_port), "--ready-file", str(serve_ready)), serve_ready)
        url = group.wait_ready([serve], options.ready_timeout_s)["serve"][0]
        generate = ["agora-node", "generate", *options.run_flags(), *swarm, *admission, "--prompt", "def "]
        model = f"agora-{load_config(options.config).name}"
        print(f"demo: serving {options.checkpoint} at {url} ({len(workers)} serve-only workers, "
              f"{options.replicas} per stage); Ctrl-C stops", file=out, flush=True)
        print(f"demo: try: curl {url}/completions -H 'content-type: application/json' -d "
              f"'{{\"model\": \"{model}\", \"prompt\": \"def \", \"max_tokens\": 32}}'", file=out, flush=True)
        if options.insecure:  # with admission, a generate process needs a state dir of its own
            print(f"demo: or: {shlex.join(generate)}", file=out, flush=True)
        reported: set[str] = set()
        while serve.alive():
            for worker in workers:
                if not worker.alive() and worker.name not in reported:
                    reported.add(worker.name)
                    print(f"demo: {worker.name} exited with {worker.process.returncode}; the other replicas "
                          "keep serving", file=out, flush=True)
            time.sleep(0.5)  # the supervision loop's pace; Ctrl-C interrupts it
        print(f"demo: serve exited with {serve.process.returncode}:\n{serve.log_tail()}", file=sys.stderr)
        code = 1
    except ChildFailed as error:
        print(f"demo: {error}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("demo: stopping", file=out, flush=True)
    finally:
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        group.shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code
