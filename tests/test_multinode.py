"""Two real hosts on this machine (launch/local_cluster.sh: two network namespaces joined by a veth link,
an sshd in each, the checkout shared through the file system), driven by the deepspeed launcher with a
hostfile, as on a cluster:

* the GPT job with ZeRO-2 and Adam8bitBlock, one rank per host, started through pdsh and through
  MPICH's mpirun (ssh), gives the same losses as the same job with 2 ranks on one host;
* a host lost mid-run (its link taken down, its processes killed): the surviving rank ends within
  --dist_timeout plus a margin, saying it lost contact, and the last complete checkpoint passes its
  completion and CRC-32 checks;
* that checkpoint resumes on one host with one rank (universal conversion), bit for bit like the same
  2-then-1-rank path taken without the loss.

Needs root, `ip netns` and apt (for openssh-server and pdsh); skipped with the reason otherwise.
Wall times are printed (pytest -s) and written to multinode_times.json in pytest's base temporary folder.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.train import LAUNCH, REPO, env, metrics, run, summary

import checkpointing  # noqa: E402  (launch/, put on sys.path by helpers.train)
from metrics_log import read_metrics  # noqa: E402

# a hang guard within the suite's 25 min target: the cluster starts in under a minute and each test takes
# 20-60 s on the 2-core machines (its jobs have their own limits)
pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.timeout(1320)]

CLUSTER = LAUNCH / "local_cluster.sh"
STATE = Path("/tmp/ds_q8_cluster")  # local_cluster.sh's default
HOSTS = ("dsq8-h1", "dsq8-h2")
MASTER = "10.218.18.11"
ARGS = ["--max_steps", "3", "--eval_interval", "0", "--micro_batch", "4", "--context", "64", "--eval_batches", "2",
        "--stable_embedding", "--no_progress", "--seed", "5"]
# the lost-host job: long enough to be cut, a checkpoint every 5 steps, a short collective timeout
DIST_TIMEOUT = 30
LONG = ["--max_steps", "3000", "--save_interval", "5", "--eval_interval", "0", "--micro_batch", "4",
        "--context", "64", "--eval_batches", "2", "--stable_embedding", "--no_progress", "--seed", "5"]
KILL_AFTER = 10  # the lost host goes once the checkpoint of this step is complete
RESUMED = 4  # steps the one-rank run continues for
EXIT_MARGIN_S = 30  # past --dist_timeout: the survivor notices, prints and exits; slack for a loaded machine
TIMES: dict = {}


def _cluster_env() -> dict:
    # the ranks on both hosts run this interpreter (and find `deepspeed` next to it)
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _skip_reason():
    if os.geteuid() != 0:
        return "needs root: it creates network namespaces and runs sshd in them"
    if shutil.which("ip") is None:
        return "needs the ip command (Debian: iproute2)"
    probe = subprocess.run(["ip", "netns", "add", "dsq8-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "dsq8-probe"], capture_output=True)
    have_tools = os.path.exists("/usr/sbin/sshd") and shutil.which("pdsh") and shutil.which("ssh")
    if not have_tools and shutil.which("apt-get") is None:
        return "needs openssh-server and pdsh, and there is no apt-get to install them"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    up = run(["bash", CLUSTER, "up"], check=False, threads=1, timeout=900, extra_env=_cluster_env())
    try:
        if up.returncode != 0:
            if "apt-get" in up.stderr:
                pytest.skip(f"could not install openssh-server and pdsh: {up.stderr.strip()[-500:]}")
            raise AssertionError(f"local_cluster.sh up failed:\n{up.stdout[-2000:]}\n{up.stderr[-3000:]}")
        yield STATE
    finally:
        run(["bash", CLUSTER, "down"], check=False, timeout=120)
        left = [h for h in HOSTS if h in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout]
        left += [str(p) for p in [STATE] + [Path("/etc/netns") / h for h in HOSTS] if p.exists()]
        assert not left, f"local_cluster.sh down left {left}"
        (tmp_path_factory.getbasetemp() / "multinode_times.json").write_text(json.dumps(TIMES, indent=2) + "\n")


def on_host(host, *cmd) -> list:
    return ["bash", CLUSTER, "exec", host, *[str(c) for c in cmd]]


def two_hosts(launcher, save_dir, args, port):
    """The command and environment that start train_gpt.py on both hosts from the first one."""
    extra = dict(_cluster_env(), DS_ENV_FILE=str(STATE / "deepspeed_env"), HOSTFILE=str(STATE / "hostfile"),
                 LAUNCHER=launcher, MASTER_ADDR=MASTER, MASTER_PORT=str(port))
    if launcher == "mpich":
        extra["LAUNCHER_ARGS"] = "-launcher ssh"  # hydra starts its proxies on the other host over ssh
    return on_host(HOSTS[0], LAUNCH / "run_multi_node.sh", "--save_dir", save_dir, *args), extra


def timed_run(name, cmd, **kw):
    t0 = time.monotonic()
    proc = run(cmd, threads=1, **kw)
    TIMES[name] = round(time.monotonic() - t0, 1)
    print(f"{name}: {TIMES[name]} s")
    return proc


@pytest.fixture(scope="module")
def one_host_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("one_host")
    timed_run("one host, 2 ranks", [LAUNCH / "run_single_node.sh", "--save_dir", d, *ARGS], timeout=600,
              extra_env=dict(_cluster_env(), NUM_GPUS="2", MASTER_PORT="29651"))
    return d


@pytest.mark.parametrize("launcher, port", [("pdsh", 29653), ("mpich", 29655)])
def test_two_hosts_match_one_host(cluster, one_host_run, tmp_path, launcher, port):
    if launcher == "mpich" and shutil.which("mpirun") is None:
        pytest.skip("needs MPICH's mpirun (pip install mpich)")
    d = tmp_path / "run"
    cmd, extra = two_hosts(launcher, d, ARGS, port)
    timed_run(f"two hosts, {launcher}", cmd, timeout=600, extra_env=extra)
    s = summary(d)
    assert s["world_size"] == 2 and s["optimizer"] == "Adam8bitBlock"
    assert s["hosts"] == list(HOSTS)  # one rank on each host, not two on the first
    assert summary(one_host_run)["hosts"][0] not in HOSTS
    assert [r["loss"] for r in metrics(d)] == [r["loss"] for r in metrics(one_host_run)]


def _procs_in(host):
    """(pid, argv) of every process in the host's network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        found.append((int(pid), argv))
    return found


def _rank_pids(host, save_dir):
    return [pid for pid, argv in _procs_in(host) if str(save_dir) in argv and "--local_rank=0" in argv]


def _wait(cond, limit_s, what):
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {limit_s} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic()


@pytest.fixture(scope="module")
def lost_host(cluster, tmp_path_factory):
    """Two hosts train; once step KILL_AFTER's checkpoint is complete the second host goes away:
    its link goes down (no goodbye reaches the first host), then its processes are killed."""
    d = tmp_path_factory.mktemp("lost") / "run"
    cmd, extra = two_hosts("pdsh", d, LONG + ["--dist_timeout", str(DIST_TIMEOUT)], 29657)
    t0 = time.monotonic()
    job = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env(1, extra), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: (d / checkpointing.tag_for(KILL_AFTER) / checkpointing.MARKER).is_file() or job.poll() is not None,
              600, f"the checkpoint of step {KILL_AFTER}")
        assert job.poll() is None, job.stdout.read()[-4000:]
        survivors = _rank_pids(HOSTS[0], d)
        assert len(survivors) == 1, _procs_in(HOSTS[0])
        subprocess.run(on_host(HOSTS[1], "ip", "link", "set", "dsq8", "down"), check=True)
        lost_at = time.monotonic()
        for pid, argv in _procs_in(HOSTS[1]):
            if str(d) in " ".join(argv):  # the host's launcher and rank, not its sshd
                os.kill(pid, 9)
        exited = _wait(lambda: not Path(f"/proc/{survivors[0]}").exists(), DIST_TIMEOUT + EXIT_MARGIN_S + 60,
                       "the surviving rank to exit")
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    (d.parent / "launcher.log").write_text(out)
    TIMES["lost host run"] = round(time.monotonic() - t0, 1)
    TIMES["time to exit after the host loss"] = round(exited - lost_at, 1)
    print(f"lost host: run {TIMES['lost host run']} s, survivor exited {TIMES['time to exit after the host loss']} s "
          f"after the loss (--dist_timeout {DIST_TIMEOUT})")
    return dict(dir=d, out=out, rc=job.returncode, time_to_exit=exited - lost_at)


def test_survivor_exits_in_bounded_time_with_a_clear_message(lost_host):
    out = lost_host["out"]
    assert lost_host["rc"] != 0
    assert lost_host["time_to_exit"] <= DIST_TIMEOUT + EXIT_MARGIN_S, out[-4000:]
    assert f"rank 0 on host {HOSTS[0]}: lost contact with the other ranks" in out, out[-4000:]
    assert f"--dist_timeout={DIST_TIMEOUT} s" in out and "continue with --resume" in out, out[-4000:]


def test_last_complete_checkpoint_is_intact(lost_host):
    from ds_q8.integration.checkpoint_files import verify_file

    tag, step = checkpointing.latest_complete(lost_host["dir"])
    assert step >= KILL_AFTER
    folder = lost_host["dir"] / tag
    assert checkpointing.check_complete(folder) is None
    shards = sorted(folder.rglob("*.pt"))
    assert len([f for f in shards if "optim_states" in f.name]) == 2  # both ranks' ZeRO shards
    for f in shards:
        verify_file(f)  # every record's CRC-32


def _resume_one_rank(save_dir, stop_at, host=None):
    args = [sys.executable, LAUNCH / "train_gpt.py", "--save_dir", save_dir, "--resume",
            *LONG, "--stop_at", str(stop_at)]
    return on_host(host, *args) if host else args


def test_resume_on_one_host_is_lossless(lost_host, tmp_path):
    d = lost_host["dir"]
    tag, step = checkpointing.latest_complete(d)
    trained = read_metrics(d / "metrics.jsonl")[:step]
    # without the conversion a world-size change is refused, naming the command
    refused = run(_resume_one_rank(d, step + RESUMED, HOSTS[0]), check=False, threads=1, timeout=600,
                  extra_env=_cluster_env())
    assert refused.returncode != 0 and "ds_q8.checkpoint to-universal" in refused.stderr, refused.stderr[-3000:]
    run([sys.executable, "-m", "ds_q8.checkpoint", "to-universal", d / tag, d / f"{tag}_universal"], timeout=600)
    codes = [torch.load(f, weights_only=True) for f in sorted((d / f"{tag}_universal" / "ds_q8").glob("*.pt"))]
    assert any(c.get("eight_bit") and c["codes"][0].dtype == torch.uint8 for c in codes)  # carried code for code
    timed_run("resume on one host, 1 rank", _resume_one_rank(d, step + RESUMED, HOSTS[0]), timeout=600,
              extra_env=_cluster_env())
    s = summary(d)
    assert s["world_size"] == 1 and s["start_step"] == step and s["hosts"] == [HOSTS[0]]

    # the same path without the loss: 2 ranks to the same step (one host), converted, 1 rank on
    ref = tmp_path / "ref"
    run([LAUNCH / "run_single_node.sh", "--save_dir", ref, *LONG, "--stop_at", str(step)], threads=1, timeout=600,
        extra_env=dict(_cluster_env(), NUM_GPUS="2", MASTER_PORT="29659"))
    run([sys.executable, "-m", "ds_q8.checkpoint", "to-universal", ref / tag, ref / f"{tag}_universal"], timeout=600)
    run(_resume_one_rank(ref, step + RESUMED), threads=1, timeout=600)
    want = metrics(ref)
    assert [r["loss"] for r in trained] == [r["loss"] for r in want[:step]]  # two hosts == one host, 2 ranks
    got = metrics(d)
    assert [r["step"] for r in got] == list(range(1, step + RESUMED + 1))
    assert [r["loss"] for r in got[step:]] == [r["loss"] for r in want[step:]]


def test_cluster_script_rejects_bad_commands():
    cases = [(["bogus"], "up|down|status|exec"), (["exec", "dsq8-h3", "true"], "HOST must be one of dsq8-h1 dsq8-h2"),
             (["exec", "dsq8-h1"], "usage: exec HOST COMMAND")]
    for args, message in cases:
        proc = run(["bash", CLUSTER, *args], check=False, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
