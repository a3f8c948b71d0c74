"""Image folders for demos, tests and benchmarks, written from data that installed packages ship (nothing is
downloaded): ``python -m demo_data NAME --out DIR``. Apart from ``models/``: training reads any folder, and the
server's image leaves these out."""
