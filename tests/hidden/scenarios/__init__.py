"""What the hidden tests run in a rank: models, inputs and the bodies that report data. No expected value,
threshold or message lives here; the checks are in tests/hidden/test_*.py, which a rank never imports."""
