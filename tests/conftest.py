"""Session-wide test set-up: the embedded corpus is built into a temporary cache, so the
suite leaves nothing in ``~/.cache`` (every launched rank inherits the variable)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_corpus_cache(tmp_path_factory):
    old = os.environ.get("MINDSPEED_HA_CACHE")
    os.environ["MINDSPEED_HA_CACHE"] = str(tmp_path_factory.mktemp("corpus_cache"))
    yield
    if old is None:
        os.environ.pop("MINDSPEED_HA_CACHE", None)
    else:
        os.environ["MINDSPEED_HA_CACHE"] = old
