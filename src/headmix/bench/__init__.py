"""Benchmarks that print ratios against a named baseline measured in the same run (``headmix bench``)."""
