"""nvidia-modelopt, hidden from the jobs the test suite launches (see tests/conftest.py,
``_jobs_without_modelopt``): importing it fails, as where it is not installed."""

raise ImportError("nvidia-modelopt is hidden from this test job (tests/conftest.py: _jobs_without_modelopt)")
