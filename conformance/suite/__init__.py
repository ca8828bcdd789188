"""The conformance tests. Run them with `pytest --pyargs conformance.suite --hal-vendor NAME`
or `hal conformance --vendor NAME`."""
