"""Small runnable examples used by the notebooks, the demo and the tests."""
