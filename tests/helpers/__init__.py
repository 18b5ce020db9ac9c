"""Code the tests share: no test imports another test module (tests/test_import_graph.py checks it)."""
