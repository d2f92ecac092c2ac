"""Two JAX processes x 4 CPU devices (gloo collectives) on loopback run the decode plan together."""

import os
import re
import socket
import subprocess
import sys

from hcfjax.config import ModelConfig
from hcfjax.tensor_specs import tensor_specs
from tests.conftest import FIXTURES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_run_the_decode_plan():
    specs = tensor_specs(ModelConfig.from_json(FIXTURES / "tiny_v3"))
    experts = sum("experts" in s.path for s in specs)
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sharding.multihost",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--cpu-devices",
                "4",
                "--model",
                str(FIXTURES / "tiny_v3"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out[-2000:]
        m = re.search(
            rf"process {i} of 2: 8 devices, rel err ([0-9.e+-]+), greedy tokens identical: (\w+), "
            r"streamed shards identical: (\w+)",
            out,
        )
        assert m, out[-2000:]
        assert float(m.group(1)) < 1e-4 and m.group(2) == "True" and m.group(3) == "True"
        # Loading under the plan, each process read every tensor but the other process's experts.
        read = re.search(r"read (\d+) of (\d+) tensors", out)
        assert read and (int(read.group(1)), int(read.group(2))) == (len(specs) - experts // 2, len(specs)), out
