"""The ray executor: TP=2 as Ray actors gives the tokens of TP=1, on one node and on a
two-node cluster on loopback with one rank per node (`ray.cluster_utils.Cluster`); an actor
killed mid-run fails the pending requests at once and leaves no process; the tensor-parallel
benchmark, which runs its ranks on Ray, counts every all-reduce."""

import json
import os
import subprocess
import sys

import pytest

from tests.test_tensor_parallel import _engine, _generate, check_a_killed_worker_fails_pending_requests
from tests.utils import build_tiny_checkpoint

# Ray takes this switch to mean: nodes join on the loopback address rather than the host's
# interface. Read when ray is imported, which is why ray is imported inside the fixtures.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


@pytest.fixture(scope="module")
def uneven_checkpoint(tmp_path_factory, tokenizer_dir) -> str:
    return build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("tiny_9_3")), tokenizer_dir,
                                 hidden_size=72, num_heads=9, num_kv_heads=3)


@pytest.fixture
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


@pytest.fixture
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address)
    yield ray
    ray.shutdown()
    cluster.shutdown()


def test_tp2_on_ray_matches_tp1(local_ray, uneven_checkpoint):
    want = _generate(_engine(uneven_checkpoint, 16, tp=1))
    llm = _engine(uneven_checkpoint, 16, tp=2, distributed_executor_backend="ray")
    assert _generate(llm) == want
    llm.llm_engine.shutdown()
    assert not local_ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in local_ray.util.placement_group_table().values())


def test_tp2_across_two_ray_nodes_matches_tp1(two_node_cluster, tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    want = _generate(_engine(path, 512, tp=1))
    llm = _engine(path, 512, tp=2, distributed_executor_backend="ray")
    node_ids = llm.llm_engine.model_executor.node_ids
    assert len(set(node_ids)) == 2  # one rank per node
    assert {n["NodeManagerAddress"] for n in two_node_cluster.nodes()} == {"127.0.0.1"}
    assert _generate(llm) == want
    llm.llm_engine.shutdown()


def test_a_killed_ray_actor_fails_pending_requests_and_the_engine_is_dead(local_ray, tiny_checkpoints):
    # Ray ends an actor whose handles are gone or whose placement group is removed; the
    # executor also kills them, so the surviving rank's process is gone either way.
    check_a_killed_worker_fails_pending_requests(
        _engine(tiny_checkpoints["llama"], 16, tp=2, distributed_executor_backend="ray"))


def test_tensor_parallel_benchmark_times_every_all_reduce_in_the_worker(tiny_checkpoints, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "benchmark_tensor_parallel.py"),
         "--model", tiny_checkpoints["llama"], "--dtype", "float32", "--prefill-sizes", "16", "48",
         "--repeats", "1", "--decode-seqs", "2", "--decode-steps", "2", "--output-json", str(out)],
        cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["cpu_model"]
    one, two = result["tp"]["1"]["kinds"], result["tp"]["2"]["kinds"]
    assert set(one) == set(two) == {"prefill_16", "prefill_48", "decode_2"}
    # Two layers: one all-reduce after attention and one after the MLP each, plus the
    # vocabulary-parallel embedding's; every one of (tokens, hidden 64) float32.
    for kind, tokens in [("prefill_16", 16), ("prefill_48", 48), ("decode_2", 2)]:
        assert one[kind]["all_reduce_calls"] == 0 and one[kind]["num_tokens"] == tokens
        assert two[kind]["all_reduce_calls"] == 5
        assert two[kind]["all_reduce_bytes"] == 5 * tokens * 64 * 4
        assert 0 < two[kind]["all_reduce_ms"] < two[kind]["worker_step_ms"] <= two[kind]["engine_step_ms"]
    assert set(result["tp2_vs_tp1"]) == set(one)
