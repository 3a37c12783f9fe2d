"""The generator fleet on Ray (fast/routed_generator.py's ``ray_generators``), on a 2-node local cluster.

One drill, run in a private network and PID namespace (parity/netns.py: loopback only, and every
process it starts ends with it), on ``ray.cluster_utils.Cluster`` with two nodes and three fast
engines as actors spread over both, behind ``GeneratorRouter``, plus a one-actor fleet ("solo",
one restart allowed, a small KV pool) behind a second router that never syncs:

    0  bad requests: the engine's ValueError raised inside an actor (a token id past its vocabulary, a
       KV need beyond the pool) reaches the user as a ValueError with the engine's message, fails
       only that request, costs the actor nothing (no failure, no retry elsewhere); a prompt of
       floats or a tuple is refused by submit (TypeError)
       restart before any sync: SIGKILL solo's process, then send it requests: they wait for it
       (not fail at once) and it comes back with its construction weights (version 0)
       dead for good: SIGKILL it again (out of restarts): it is removed from its fleet with one
       health event, stats() says "dead", a sync does not wait for it
    1  tokens through the fleet equal a local engine's, at version 0 and after a drain sync
    2  SIGKILL one actor's process mid-generation: every request completes exactly once, the
       rest of the fleet keeps serving, a hot-swap sync during the restart succeeds, and the
       restarted actor is re-synced and serves the current version (its tokens checked)
    3  SIGSTOP another actor (hung, not dead): its requests finish elsewhere within their
       deadline, a drain sync with a deadline drops it and loads the others; after SIGCONT it
       is re-synced and serves the newest version
    4  SIGSTOP an actor during a hot-swap sync with a long deadline, then ``close()`` the router:
       the sync returns at once (RouterError), not at its deadline or the handle's call_timeout_s
After every sync that reports success, every generator in rotation serves the router's version.

A second test runs ``bench/rl_loop.py --ray`` (the demo) where Ray's session file names a cluster
that cannot be reached: it starts a local Ray instance and runs; with ``RAY_ADDRESS`` naming that
cluster it fails within its connect timeout, saying so.  Its output lines stay under 100 columns.

The drills write what they saw as JSON; the tests assert on it.  Skipped (saying why) only where a
namespace cannot be made; CI runs as root and runs them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DRILL_TIMEOUT_S = 420


def _engine():
    """What each actor builds (one intra-op thread: three engines share two cores)."""
    import torch

    import fast.generator_engine as ge
    torch.set_num_threads(1)
    return ge.Generator(ge.ModelConfig(**_CONFIG), seed=0, page_size=4, num_pages=256, max_batch_size=16)


_CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=8, max_seq_len=96, tie_embeddings=False)


def _small_engine(marker: str):
    """solo's engine: 8 pages of 4 tokens (a request needing more KV than 32 tokens can never fit).
    A restarted actor takes 3 s more to build it (``marker`` exists then): Ray reports the actor as
    restarting for that long, the window in which a restart used to be taken for a death."""
    import torch

    import fast.generator_engine as ge
    if os.path.exists(marker):
        time.sleep(3.0)
    Path(marker).touch()
    torch.set_num_threads(1)
    return ge.Generator(ge.ModelConfig(**_CONFIG), seed=0, page_size=4, num_pages=8, max_batch_size=4)


def _wait(predicate, timeout: float, what: str) -> float:
    """Poll until predicate() holds; seconds it took (AssertionError after timeout)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def _in_rotation_but_stale(router) -> list:
    """Generators closed or half-open that do not serve the router's version (none, after a sync that succeeded)."""
    v = router.policy_version
    return sorted(n for n, s in router.stats().items() if s["state"] in ("closed", "half_open")
                  and s["policy_version"] != v)


def solo_drill(rg, facts: dict, temp_dir: str) -> None:
    """Step 0: bad requests, a restart before any sync, an actor dead for good (module docstring)."""
    import functools

    import torch
    marker = os.path.join(temp_dir, "solo-built")
    solo = rg.ray_generators(functools.partial(_small_engine, marker), 1, name_prefix="solo", max_restarts=1,
                             num_cpus=0, call_timeout_s=60)
    router = rg.GeneratorRouter(solo, request_timeout_s=30.0, backoff_s=(0.2, 1.0), sync_timeout_s=30.0)
    g = solo[0]
    # Bad requests: raised inside the actor, they fail alone, with the engine's message.
    bad = {"vocab": rg.Request([1, 2, 96], rg.SamplingParams(max_new_tokens=4, temperature=0.9)),
           "kv": rg.Request(list(range(1, 21)), rg.SamplingParams(max_new_tokens=40))}
    facts["bad"] = {}
    for what, r in bad.items():
        exc = router.submit(r).exception(60)
        decorated = any(mark in str(exc) for mark in ("\x1b", "\\x1b", "Traceback", "ray::"))  # Ray's remote traceback
        facts["bad"][what] = [type(exc).__name__, decorated, str(exc)[:200]]
    for what, prompt in (("floats", [1.0, 2.0]), ("tuple", (1, 2, 3))):
        r = rg.Request([1, 2, 3])
        r.prompt_token_ids = prompt
        for where, submit in (("router", router.submit), ("handle", g.submit)):
            try:
                submit(r)
                facts["bad"][f"{what}-{where}"] = None
            except (TypeError, ValueError) as exc:
                facts["bad"][f"{what}-{where}"] = [type(exc).__name__, str(exc)[:200]]
    st = router.stats()["solo0"]
    facts["bad_cost"] = [st["dispatched"], st["failures"], st["state"]]
    out = router.generate([rg.Request([5, 6, 7], rg.SamplingParams(max_new_tokens=4))])
    facts["solo_serves"] = [out[0].generator_id, out[0].min_policy_version]
    router.health_events()
    # A restart before any sync: the requests wait for the actor, which returns at version 0.
    os.kill(g.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    futures = [router.submit(rg.Request([i + 1, 2, 3], rg.SamplingParams(max_new_tokens=4))) for i in range(3)]
    outcomes = []
    for f in futures:
        exc = f.exception(60)
        outcomes.append(repr(exc)[:300] if exc else [f.result().generator_id, f.result().min_policy_version])
    facts["restart_outcomes"] = outcomes
    facts["restart_served_s"] = time.monotonic() - t_kill
    facts["restart_state"] = [router.stats()["solo0"]["state"], g.policy_version, getattr(g, "dead", None)]
    facts["restart_events"] = [e for _, _, e, _ in router.health_events()]
    if g.policy_version != 0:  # the handle never heard from the new process: no pid to kill
        router.close()
        return
    # Dead for good: out of restarts.  One health event; later syncs do not wait for it.
    os.kill(g.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    exc = router.submit(rg.Request([9, 9], rg.SamplingParams(max_new_tokens=4))).exception(60)
    facts["dead_request"] = [type(exc).__name__, str(exc)[:300], time.monotonic() - t_kill]
    time.sleep(3.0)  # back-offs (0.2 .. 1 s) would have re-admitted it several times by now
    facts["dead_state"] = [router.stats()["solo0"]["state"], getattr(g, "dead", None)]
    facts["dead_events"] = [e for _, name, e, _ in router.health_events() if name == "solo0"]
    t0 = time.monotonic()
    try:
        router.sync_weights({k: torch.zeros(1) for k in ("x",)}, 1)
        facts["dead_sync"] = None
    except rg.RouterError as exc:
        facts["dead_sync"] = [str(exc)[:300], time.monotonic() - t0]
    router.close()


def _requests(rg, tag, n, max_new=8, seed=0):
    import torch
    gen = torch.Generator().manual_seed(seed)
    return [rg.Request(torch.randint(0, 96, (int(torch.randint(3, 20, (), generator=gen)),), generator=gen).tolist(),
                       rg.SamplingParams(max_new_tokens=max_new, temperature=0.0 if i % 2 else 0.9, seed=i),
                       request_id=f"{tag}-{i}") for i in range(n)]


def drill(out_path: str) -> None:
    sys.path.insert(0, str(ROOT))
    import ray
    import torch
    from ray.cluster_utils import Cluster

    import fast.generator_engine as ge
    import fast.routed_generator as rg
    torch.set_num_threads(1)
    facts: dict = {}
    t0 = time.monotonic()
    temp_dir = tempfile.mkdtemp(prefix="rayf", dir="/tmp")  # short: Ray's socket paths live under it
    # Cluster() writes its address to <Ray's temp root>/ray_current_cluster, /tmp/ray by default: on a
    # machine where Ray never ran that directory is missing (FileNotFoundError), and elsewhere the file
    # would name this namespace's cluster, gone once the test ends, to every later ray.init() there.
    os.makedirs(f"{temp_dir}/ray")
    os.environ["RAY_TMPDIR"] = temp_dir
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, include_dashboard=False, temp_dir=temp_dir))
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    facts["cluster_up_s"] = time.monotonic() - t0
    gens = rg.ray_generators(_engine, 3, num_cpus=1, call_timeout_s=60)
    facts["actors_up_s"] = time.monotonic() - t0
    facts["nodes"] = len({g.node_id for g in gens})
    router = rg.GeneratorRouter(gens, policy="least_loaded", request_timeout_s=60.0, backoff_s=(0.5, 2.0),
                                sync_timeout_s=60.0)
    stale = facts["stale_after_sync"] = []  # [(version, generators in rotation on another version)]
    solo_drill(rg, facts, temp_dir)
    facts["solo_s"] = time.monotonic() - t0 - facts["actors_up_s"]
    # A token id past the engine's vocabulary (the router cannot know it), through the three-actor fleet:
    # one attempt, nobody struck.
    exc = router.submit(rg.Request([1, 2, 96], rg.SamplingParams(max_new_tokens=4))).exception(60)
    facts["fleet_bad_token"] = [type(exc).__name__, sum(s["dispatched"] for s in router.stats().values()),
                               sum(s["failures"] for s in router.stats().values())]
    cfg = ge.ModelConfig(**_CONFIG)
    weights = {v: {k: t.clone() for k, t in ge.DecoderLM(cfg, seed=v).state_dict().items()} for v in (1, 2, 3)}

    def local(version, requests):
        with ge.Generator(cfg, seed=0, state_dict=weights.get(version)) as g:
            return {c.request_id: c.token_ids for c in g.generate(requests)}

    def same_tokens(version, completions, requests):
        expect = local(version, requests)
        return all(c.token_ids == expect[c.request_id] for c in completions)

    # 1. the fleet computes what a local engine computes
    batch = _requests(rg, "v0", 12)
    outs = router.generate(batch)
    facts["v0_tokens_equal"] = same_tokens(0, outs, batch)
    facts["v0_served_by"] = sorted({c.generator_id for c in outs})
    # A group (n samples of one prompt) through an actor: the engine's n completions, as a local engine's.
    group = rg.Request([3, 1, 4, 1, 5], rg.SamplingParams(max_new_tokens=5, temperature=1.0, seed=9, n=3),
                       request_id="group")
    samples = router.generate([group])[0]
    with ge.Generator(cfg, seed=0) as g:
        expect = g.generate([group])[0]
    facts["group"] = [[c.sample_index for c in samples],
                      [c.token_ids for c in samples] == [c.token_ids for c in expect]]
    router.sync_weights(weights[1], 1, mode="drain")
    stale.append((1, _in_rotation_but_stale(router)))
    batch = _requests(rg, "v1", 12, seed=1)
    outs = router.generate(batch)
    facts["v1_tokens_equal"] = same_tokens(1, outs, batch) and {c.min_policy_version for c in outs} == {1}

    # 2. SIGKILL one actor mid-generation
    victim = gens[0]
    long = _requests(rg, "kill", 24, max_new=40, seed=2)
    futures = [router.submit(r) for r in long]
    deadline = time.monotonic() + 60
    while router.stats()[victim.name]["inflight"] == 0 or router.stats()[victim.name]["completed"] < 1:
        assert time.monotonic() < deadline, "the victim never got work"
        time.sleep(0.01)
    killed_pid, t_kill = victim.pid, time.monotonic()
    os.kill(killed_pid, signal.SIGKILL)
    results = [f.result(120) for f in futures]
    facts["kill_completed"] = len(results)
    facts["kill_unique_ids"] = len({c.request_id for c in results})
    facts["kill_ids_match"] = sorted(c.request_id for c in results) == sorted(r.request_id for r in long)
    facts["kill_victim_failures"] = router.stats()[victim.name]["failures"]
    facts["kill_tokens_equal"] = same_tokens(1, results, long)
    router.sync_weights(weights[2], 2, mode="hot_swap")  # while the victim restarts: it is skipped
    stale.append((2, _in_rotation_but_stale(router)))
    facts["sync_during_restart_version"] = router.policy_version
    facts["survivors_version"] = [g.policy_version for g in gens[1:]]
    back, n = None, 0
    while back is None and time.monotonic() < t_kill + 120:  # traffic until the victim serves again
        probe = _requests(rg, f"back{n}", 6, seed=100 + n)
        n += 1
        outs = router.generate(probe)
        mine = [c for c in outs if c.generator_id == victim.name]
        if mine:
            back = (time.monotonic() - t_kill, mine, probe)
    assert back is not None, f"the killed actor never came back: {router.stats()[victim.name]}"
    facts["death_to_return_s"], mine, probe = back
    facts["returned_versions"] = sorted({(c.min_policy_version, c.max_policy_version) for c in mine})
    served = {c.request_id for c in mine}
    facts["returned_tokens_equal"] = same_tokens(2, mine, [r for r in probe if r.request_id in served])
    facts["returned_new_pid"] = victim.pid != killed_pid
    events = router.health_events()
    facts["victim_events"] = [e for _, g, e, _ in events if g == victim.name]

    # 3. a hung actor (SIGSTOP): deadlines move its requests elsewhere; a drain sync drops it
    hung = gens[1]
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        batch = _requests(rg, "hung", 9, seed=3)
        t_hung = time.monotonic()
        futures = [router.submit(r, timeout_s=3.0) for r in batch]
        facts["hung_inflight"] = router.stats()[hung.name]["inflight"]
        try:  # it waits for the hung requests (drain), which time out; then its load never returns
            router.sync_weights(weights[3], 3, mode="drain", timeout_s=6.0)
            facts["hung_sync_error"] = None
        except rg.RouterError as exc:
            facts["hung_sync_error"] = sorted({name for name, _ in exc.causes})
        facts["hung_sync_s"] = time.monotonic() - t_hung
        facts["hung_sync_version"] = router.policy_version
        outs = [f.result(60) for f in futures]
        facts["hung_latency_s"] = time.monotonic() - t_hung
        facts["hung_served_by"] = sorted({c.generator_id for c in outs})
        facts["hung_timeouts"] = router.stats()[hung.name]["timeouts"]
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    deadline = time.monotonic() + 90
    while router.stats()[hung.name]["state"] != "closed" and time.monotonic() < deadline:
        router.generate(_requests(rg, f"cont{int(time.monotonic() * 1e3)}", 4, seed=5))
    facts["hung_back"] = router.stats()[hung.name]["state"]
    facts["hung_version"] = hung.policy_version
    outs = router.generate(_requests(rg, "final", 9, seed=6))
    facts["final_versions"] = sorted({c.min_policy_version for c in outs})
    facts["final_served_by"] = sorted({c.generator_id for c in outs})
    stats = router.stats()
    facts["late"] = sum(s["late"] for s in stats.values())
    facts["events"] = [(round(t - t0, 3), g, e) for t, g, e, _ in events + router.health_events()]

    # 4. close() during a hot-swap sync that waits for a hung actor: the sync ends at close()
    frozen = gens[2]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        box = {}

        def sync4():
            try:
                router.sync_weights(weights[1], 4, mode="hot_swap", timeout_s=60.0)
            except Exception as exc:  # noqa: BLE001 - reported through box
                box["error"] = exc
        thread = threading.Thread(target=sync4, daemon=True)
        thread.start()
        _wait(lambda: all(g.policy_version == 4 for g in gens[:2]), 60, "the others to load 4")
        t_close = time.monotonic()
        router.close()
        thread.join(30)
        facts["close_sync"] = [thread.is_alive(), time.monotonic() - t_close, type(box.get("error")).__name__,
                               str(box.get("error"))[:300]]
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    t_close = time.monotonic()
    for g in gens:
        g.close()
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    facts["shutdown_s"] = time.monotonic() - t_close
    facts["total_s"] = time.monotonic() - t0
    Path(out_path).write_text(json.dumps(facts))


def _run_isolated(mode: str, tmp_path, timeout: float) -> dict:
    """This file's ``mode`` entry point in a private network namespace (loopback only), bounded by
    ``timeout``; returns the facts it wrote.  Skips where Ray or the namespace is unavailable."""
    pytest.importorskip("ray")
    from netns import run_isolated, unavailable
    why = unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "facts.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TRITON_INTERPRET")}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    proc = run_isolated([sys.executable, __file__, mode, str(out)], timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0 and out.exists(), f"the {mode} run failed:\n{proc.stdout[-8000:]}"
    return json.loads(out.read_text())


def test_ray_fleet_survives_a_killed_and_a_hung_actor(tmp_path):
    f = _run_isolated("drill", tmp_path, DRILL_TIMEOUT_S)
    print({k: v for k, v in f.items() if k != "events"})
    assert f["nodes"] == 2, "the actors did not spread over both nodes"
    assert f["v0_tokens_equal"] and f["v1_tokens_equal"] and len(f["v0_served_by"]) >= 2
    assert f["group"] == [[0, 1, 2], True], f["group"]
    # a killed actor: nothing lost or served twice, the fleet serves on, syncs work, it returns current
    assert f["kill_completed"] == f["kill_unique_ids"] == 24 and f["kill_ids_match"] and f["kill_tokens_equal"]
    assert f["kill_victim_failures"] >= 1
    assert f["sync_during_restart_version"] == 2 and f["survivors_version"] == [2, 2]
    assert f["returned_new_pid"] and f["returned_versions"] == [[2, 2]] and f["returned_tokens_equal"]
    events = f["victim_events"]
    assert "resynced" in events and events.index("opened") < events.index("resynced")
    # a hung actor: requests finish elsewhere within their deadline; a drain sync drops it
    assert f["hung_inflight"] >= 1 and f["hung_timeouts"] >= 1 and "ray-gen1" not in f["hung_served_by"]
    assert f["hung_latency_s"] < 3.0 + 6.0 + 5.0  # its deadline, the sync's, and the work
    assert f["hung_sync_error"] == ["ray-gen1"] and f["hung_sync_version"] == 3 and f["hung_sync_s"] < 6.0 + 2.0
    assert f["hung_back"] == "closed" and f["hung_version"] == 3 and f["final_versions"] == [3]
    assert f["shutdown_s"] < 30
    # issue 22: after a sync that reported success, nobody in rotation serves another version
    assert all(names == [] for _, names in f["stale_after_sync"]), f["stale_after_sync"]
    # a request error raised inside an actor: its own type, the engine's message, it alone fails
    for what in ("vocab", "kv"):
        kind, decorated, text = f["bad"][what]
        assert kind == "ValueError" and not decorated, f["bad"][what]
    assert "token ids in [0, 96)" in f["bad"]["vocab"][2] and "can never fit" in f["bad"]["kv"][2], f["bad"]
    assert all(f["bad"][f"{w}-{where}"][0] == "TypeError" for w in ("floats", "tuple")
               for where in ("router", "handle")), f["bad"]
    assert f["bad_cost"] == [2, 0, "closed"] and f["solo_serves"] == ["solo0", 0], (f["bad_cost"], f["solo_serves"])
    assert f["fleet_bad_token"] == ["ValueError", 1, 0], f["fleet_bad_token"]  # one attempt, nobody struck
    # a restart before any sync: the requests waited for it; it is back with its construction weights
    assert f["restart_outcomes"] == [["solo0", 0]] * 3, f["restart_outcomes"]
    assert f["restart_state"] == ["closed", 0, False] and f["restart_served_s"] < 30, f["restart_state"]
    assert "opened" in f["restart_events"] and f["restart_events"][-1] == "closed", f["restart_events"]
    # dead for good: removed once, reported, and no sync waits for it
    kind, text, _ = f.get("dead_request", [None, "", None])
    assert kind == "RouterError" and "every generator is dead" in text, f["dead_request"]
    assert f["dead_state"] == ["dead", True], f["dead_state"]
    assert f["dead_events"].count("removed") == 1 and f["dead_events"][-1] == "removed", f["dead_events"]
    assert f["dead_sync"] is not None and "dead" in f["dead_sync"][0] and f["dead_sync"][1] < 5, f["dead_sync"]
    # close() during a hot-swap sync that waits for a hung actor: it returns at once
    alive, waited, kind, text = f["close_sync"]
    assert not alive and waited < 5 and kind == "RouterError" and "closed" in text, f["close_sync"]


UNREACHABLE = "10.255.255.1:6379"  # in a namespace with loopback only, no route leads there
DEMO_FLAGS = ("--size", "--steps", "--ray", "--kill-at", "--batch-invariant")


def startup_drill(out_path: str) -> None:
    """The demo with Ray's session file (``ray_current_cluster`` in its temp directory) naming a
    cluster that cannot be reached: once with RAY_ADDRESS naming it too, once without."""
    temp_dir = tempfile.mkdtemp(prefix="rays", dir="/tmp")  # Ray's temp directory for these runs only
    os.makedirs(f"{temp_dir}/ray")
    Path(f"{temp_dir}/ray/ray_current_cluster").write_text(UNREACHABLE + "\n")
    env = dict(os.environ, RAY_TMPDIR=temp_dir)
    demo = [sys.executable, str(ROOT / "bench" / "rl_loop.py")]
    facts = {}
    t0 = time.monotonic()
    run = subprocess.run([*demo, "--ray", "--steps", "1"], env=dict(env, RAY_ADDRESS=UNREACHABLE),
                         capture_output=True, text=True, timeout=120)
    facts["explicit"] = [run.returncode, time.monotonic() - t0, run.stderr[-800:]]
    t0 = time.monotonic()
    run = subprocess.run([*demo, "--ray", "--steps", "3"], env=env, capture_output=True, text=True, timeout=150)
    facts["local"] = [run.returncode, time.monotonic() - t0, run.stdout, run.stderr[-3000:]]
    facts["help"] = subprocess.run([*demo, "--help"], capture_output=True, text=True, timeout=60).stdout
    shutil.rmtree(temp_dir, ignore_errors=True)
    Path(out_path).write_text(json.dumps(facts))


def _help_text(usage: str, flag: str) -> str:
    """The help argparse prints for ``flag`` (on its line, or on the next when the flag is long)."""
    lines = usage.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip().startswith(flag))
    rest = lines[i].strip().split("  ", 1)
    if len(rest) == 2 and rest[1].strip():
        return rest[1].strip()
    nxt = lines[i + 1] if i + 1 < len(lines) else ""
    return nxt.strip() if nxt.startswith(" " * 8) and not nxt.strip().startswith("-") else ""


def test_ray_startup_is_bounded_and_the_demo_reads_well(tmp_path):
    f = _run_isolated("startup", tmp_path, 360)
    code, took, err = f["explicit"]  # RAY_ADDRESS names a cluster nobody reaches: a clear error, in time
    assert code != 0 and took < 60 and f"RAY_ADDRESS={UNREACHABLE} did not answer" in err, f["explicit"]
    code, took, stdout, err = f["local"]  # no address: a local instance, whatever the session file says
    print(f"demo with a stale session file: {took:.1f} s\n{stdout}")
    assert code == 0, f"the demo failed ({took:.0f} s):\n{stdout[-3000:]}\n{err}"
    lines = stdout.splitlines()
    assert all(len(line) < 100 for line in lines), [line for line in lines if len(line) >= 100]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3 and all("tok/s" in line and "compared)" in line for line in steps), steps
    assert all("n/a" in line for line in steps if "(0/" in line), steps  # nothing compared: n/a, not 0
    assert any(line.startswith("totals over 3 steps") for line in lines), lines
    for flag in DEMO_FLAGS:
        assert _help_text(f["help"], flag), f"--help says nothing about {flag}:\n{f['help']}"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "drill":
    drill(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "startup":
    startup_drill(sys.argv[2])
