"""Coverage-guided fuzz harnesses (atheris) for every decoder of bytes from disk or the wire.

One module per target, each runnable as `python -m fuzz.<target> [libFuzzer flags]`
(e.g. `-runs=10000` or `-max_total_time=60`). A *crash* is any exception other than
the decoder's documented error types; see fuzz/README.md.
"""
