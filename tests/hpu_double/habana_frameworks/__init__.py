"""Test double of Intel Gaudi's `habana_frameworks` (tests/hpu_double/README.md)."""
