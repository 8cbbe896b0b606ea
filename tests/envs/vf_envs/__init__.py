"""verifiers environments written for the tests, against the real package (``tests/envs/test_vf_env.py``)."""
