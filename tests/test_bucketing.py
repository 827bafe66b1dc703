"""Token buckets: generation from config and environment, selection, padding bound."""

import pytest

from vllm.worker.bucketing import BucketConfig, bucket_config_from_env, find_bucket, generate_buckets


def test_exponential_and_linear_lists():
    assert generate_buckets(BucketConfig(min=16, step=128, max=512)) == [16, 32, 64, 128, 256, 512]
    assert generate_buckets(BucketConfig(min=16, step=128, max=384)) == [16, 32, 64, 128, 256, 384]
    assert generate_buckets(BucketConfig(min=16, step=128, max=512, exponential=False)) == [16, 128, 256, 384, 512]
    assert generate_buckets(BucketConfig(min=4, step=4, max=4)) == [4]


@pytest.mark.parametrize("budget", [1, 4, 16, 64, 100, 512, 2048])
@pytest.mark.parametrize("exponential", [True, False])
def test_every_schedulable_step_has_a_bucket_with_bounded_padding(budget, exponential):
    cfg = BucketConfig(min=min(16, budget), step=128, max=budget, exponential=exponential)
    buckets = generate_buckets(cfg)
    for n in range(1, budget + 1):
        b = find_bucket(buckets, n)
        assert b is not None and b >= n
        if exponential:  # at most double, or the minimum bucket
            assert b <= max(2 * n, cfg.min)
        else:
            assert b - n < max(cfg.step, cfg.min)
    assert find_bucket(buckets, budget + 1) is None


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("VLLM_TOKEN_BUCKET_MIN", "32")
    monkeypatch.setenv("VLLM_EXPONENTIAL_BUCKETING", "false")
    monkeypatch.setenv("VLLM_TOKEN_BUCKET_STEP", "64")
    assert generate_buckets(bucket_config_from_env(256)) == [32, 64, 128, 192, 256]
    monkeypatch.setenv("VLLM_TOKEN_BUCKET_MAX", "100")
    with pytest.raises(ValueError, match="VLLM_TOKEN_BUCKET_MAX"):
        bucket_config_from_env(256)
    monkeypatch.setenv("VLLM_TOKEN_BUCKET_MAX", "abc")
    with pytest.raises(ValueError, match="not an integer"):
        bucket_config_from_env(256)
