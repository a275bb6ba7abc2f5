"""tokenmill's own measurement tooling (`make bench` and friends), kept out of the installed package.

Run from the repository root, e.g. `python -m benchmarks.make_bench --help`. The modules import the
installed `tokenmill` package; what users run (`tokenmill bench ...`, `tokenmill plan`) lives in
`tokenmill.bench` (and `tokenmill.planning`) instead.
"""
