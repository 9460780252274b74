"""The test suite: folders mirror the packages; shared helpers in tests/support."""
