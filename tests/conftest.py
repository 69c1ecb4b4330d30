"""Fixtures shared by the kernel tests: the MINI spec derived from kimi-k3, and its weights."""
import pytest

from perfmodel.arch import load_model


@pytest.fixture(scope="session")
def spec():
    return load_model("kimi-k3-mini")


@pytest.fixture(scope="session")
def weights(spec):
    from kernels import reference  # jax only for the tests that ask for weights
    return reference.init_weights(spec, seed=0)
