"""The test suite, as a package: the harness imports as ``tests.harness``, and test modules in subfolders that
have an __init__.py get unique names (tests.public.test_x, tests.hidden.test_x)."""
